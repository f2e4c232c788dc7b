"""The `hybrid` policy (Sarathi-Serve chunked prefill) driven by a pipelined fake executor: no model."""
import random
from collections import deque

from fake_pipeline import check_batch

from tdpipe.config import SchedulerConfig
from tdpipe.core.block_manager import BlockManager
from tdpipe.core.scheduler import HybridScheduler, get_policy, make_scheduler
from tdpipe.sampling.params import SamplingParams
from tdpipe.sequence import Sequence, SequenceStatus


class Log:
    """What the fake executor saw: every batch as (batch, rows) with rows = [(seq, n, kind)]."""

    def __init__(self):
        self.batches = []
        self.finished = []
        self.max_in_flight = 0


def _check_batch(sched, bm, batch, running_before, in_flight_ids):
    check_batch(sched, bm, batch, in_flight_ids)  # the invariants every policy keeps
    rows = []
    for s, n in zip(batch.seqs, batch.num_new_tokens):
        decode = s.seq_id in running_before and n == 1 and s.num_computed_tokens == s.num_tokens - 1
        rows.append((s, n, "decode" if decode else "prefill"))
    kinds = [k for _, _, k in rows]
    assert kinds == sorted(kinds), f"decodes must precede prefill chunks: {kinds}"  # "decode" < "prefill"
    assert batch.is_prefill == ("prefill" in kinds)
    return rows


def _complete(sched, batch, log):
    """The engine's protocol: KV grows by the chunk; a token is sampled only when the prefill is done."""
    log.finished += sched.update_from_output(batch, [7] * len(batch.sampled_rows()))


def run_pipelined(sched, bm, seqs, depth=1, arrivals=None, max_steps=200_000):
    """Keep up to `depth` micro-batches in flight: schedule until None or `depth`, then finish the oldest."""
    pending = deque(seqs)
    in_flight: deque = deque()
    log = Log()
    steps = 0
    while pending or in_flight or sched.has_unfinished():
        steps += 1
        assert steps < max_steps, "no progress"
        while pending and (arrivals is None or arrivals(steps)):
            sched.add(pending.popleft())
            if arrivals is not None:
                break
        while len(in_flight) < depth:
            running_before = {s.seq_id for s in sched.running}
            in_flight_ids = {s.seq_id for b in in_flight for s in b.seqs}
            batch = sched.schedule()
            if batch is None:
                break
            log.batches.append((batch, _check_batch(sched, bm, batch, running_before, in_flight_ids)))
            in_flight.append(batch)
            log.max_in_flight = max(log.max_in_flight, len(in_flight))
        if not in_flight:
            assert pending, "stalled with nothing in flight and work pending"
            continue
        _complete(sched, in_flight.popleft(), log)
    return log


def make(num_blocks=256, block_size=4, max_seqs=8, budget=16, depth=1):
    bm = BlockManager(num_blocks, block_size)
    cfg = SchedulerConfig(policy="hybrid", max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                          max_model_len=4096, pipeline_depth=depth)
    return make_scheduler(cfg, bm), bm


def mkseq(i, prompt, out):
    return Sequence(i, str(i), [1] * prompt, SamplingParams(max_tokens=out), max_tokens=out)


def _check_all_finished(log, seqs, bm):
    ids = [s.seq_id for s in log.finished]
    assert sorted(ids) == sorted(s.seq_id for s in seqs) and len(ids) == len(set(ids))
    assert all(len(s.output_token_ids) == s.max_tokens for s in seqs)
    bm.check_no_leaks()


def test_registered_and_default_budget():
    sched, _ = make()
    assert isinstance(sched, HybridScheduler)
    assert get_policy("hybrid").configure(SchedulerConfig(policy="hybrid")).max_num_batched_tokens == 512


def test_budget_and_max_num_seqs_never_exceeded():
    for depth in (1, 2, 3):
        sched, bm = make(max_seqs=3, budget=10, depth=depth)
        seqs = [mkseq(i, 7 + i % 5, 4 + i % 3) for i in range(12)]
        log = run_pipelined(sched, bm, seqs, depth=depth)  # the limits are asserted on every batch
        _check_all_finished(log, seqs, bm)
        assert max(b.num_tokens for b, _ in log.batches) == 10  # the budget is actually filled
        # rows per micro-batch: up to max_num_seqs, the decodes split over the `depth` micro-batches in flight
        assert max(len(b) for b, _ in log.batches) == (3 if depth == 1 else 2)


def test_long_prompt_is_chunked_and_samples_only_after_the_last_chunk():
    sched, bm = make(budget=16)
    seq = mkseq(0, 50, 3)
    sched.add(seq)
    chunks = []
    for _ in range(4):
        b = sched.schedule()
        assert b.is_prefill and b.seqs == [seq]
        # KV is allocated for the chunk only, not for the whole prompt
        assert len(seq.block_table) == bm.blocks_needed(seq.num_computed_tokens + b.num_new_tokens[0])
        assert sched.schedule() is None  # in flight: never scheduled twice
        chunks.append(b.num_new_tokens[0])
        assert seq.output_token_ids == []
        _complete(sched, b, Log())
    assert chunks == [16, 16, 16, 2]
    assert seq.output_token_ids == [7] and seq.num_computed_tokens == 50
    b = sched.schedule()  # now a decode
    assert not b.is_prefill and b.num_new_tokens == [1]


def test_decodes_first_then_a_chunk_fills_the_budget():
    sched, _ = make(budget=16, max_seqs=8)
    short = [mkseq(i, 2, 20) for i in range(3)]
    for s in short:
        sched.add(s)
    b = sched.schedule()
    assert b.is_prefill and b.num_new_tokens == [2, 2, 2]
    _complete(sched, b, Log())
    long = mkseq(9, 39, 2)
    sched.add(long)
    b = sched.schedule()
    assert b.seqs == short + [long]
    assert b.num_new_tokens == [1, 1, 1, 13] and b.is_prefill  # 3 decodes + 13-token chunk = budget 16
    _complete(sched, b, Log())
    assert long.output_token_ids == [] and long.status is SequenceStatus.RUNNING
    b = sched.schedule()
    assert b.num_new_tokens == [1, 1, 1, 13]
    _complete(sched, b, Log())
    b = sched.schedule()
    assert b.num_new_tokens == [1, 1, 1, 13] and b.seqs[-1] is long  # the last chunk: 39 = 13 + 13 + 13
    _complete(sched, b, Log())
    assert long.output_token_ids == [7]
    b = sched.schedule()
    assert b.num_new_tokens == [1, 1, 1, 1] and not b.is_prefill


def test_mixed_batches_happen_under_load():
    rng = random.Random(3)
    sched, bm = make(num_blocks=512, budget=32, max_seqs=16, depth=2)
    seqs = [mkseq(i, rng.randint(5, 60), rng.randint(5, 30)) for i in range(40)]
    log = run_pipelined(sched, bm, seqs, depth=2, arrivals=lambda step: step % 3 == 0)
    _check_all_finished(log, seqs, bm)
    mixed = [rows for _, rows in log.batches if {k for _, _, k in rows} == {"decode", "prefill"}]
    assert len(mixed) > 10
    assert log.max_in_flight == 2
    # a prompt split over several micro-batches: some sequence had more than one prefill chunk
    chunks: dict[int, int] = {}
    for _, rows in log.batches:
        for s, n, k in rows:
            if k == "prefill":
                chunks[s.seq_id] = chunks.get(s.seq_id, 0) + 1
    assert max(chunks.values()) > 1


def test_first_token_only_after_the_whole_prompt_has_kv():
    rng = random.Random(5)
    sched, bm = make(num_blocks=512, budget=12, max_seqs=6, depth=2)
    seqs = [mkseq(i, rng.randint(1, 45), rng.randint(1, 6)) for i in range(20)]
    prompt_tokens_done: dict[int, int] = {}
    orig = sched.on_result

    def on_result(batch):
        for s, n in zip(batch.seqs, batch.num_new_tokens):
            if s.num_preemptions == 0:
                prompt_tokens_done[s.seq_id] = prompt_tokens_done.get(s.seq_id, 0) + n
            if len(s.output_token_ids) == 1 and s.num_preemptions == 0 and s.num_computed_tokens == s.num_tokens - 1:
                assert prompt_tokens_done[s.seq_id] == s.num_prompt_tokens
        orig(batch)

    sched.on_result = on_result
    log = run_pipelined(sched, bm, seqs, depth=2)
    _check_all_finished(log, seqs, bm)


def test_preemption_under_a_tiny_kv_cache_still_finishes_everything():
    for depth in (1, 2, 3):
        # 12 blocks of 4 tokens = 48 token slots; 6 requests of 4 + 20 tokens cannot all run at once
        sched, bm = make(num_blocks=12, block_size=4, max_seqs=6, budget=16, depth=depth)
        seqs = [mkseq(i, 4, 20) for i in range(6)]
        log = run_pipelined(sched, bm, seqs, depth=depth)
        _check_all_finished(log, seqs, bm)
        assert sched.num_preemptions > 0
        assert sum(s.num_preemptions for s in seqs) == sched.num_preemptions


def test_recompute_prefills_prompt_and_outputs_again_in_chunks():
    sched, bm = make(num_blocks=10, block_size=4, max_seqs=4, budget=8)
    seqs = [mkseq(i, 12, 16) for i in range(3)]  # 28 tokens each, 40 slots: someone is preempted
    recompute_chunks = []
    orig = sched.schedule

    def schedule():
        b = orig()
        if b is not None:
            for s, n in zip(b.seqs, b.num_new_tokens):
                if s.num_preemptions and s.output_token_ids and s.num_computed_tokens < s.num_tokens - 1:
                    recompute_chunks.append((s.seq_id, s.num_computed_tokens, n, s.num_tokens))
        return b

    sched.schedule = schedule
    log = run_pipelined(sched, bm, seqs)
    _check_all_finished(log, seqs, bm)
    assert sched.num_preemptions > 0 and recompute_chunks
    # a recompute starts again from 0 and covers more than the prompt (its outputs too), in chunks <= 8
    assert any(c == 0 for _, c, _, _ in recompute_chunks)
    assert any(t > 12 for _, _, _, t in recompute_chunks)
    assert all(n <= 8 for _, _, n, _ in recompute_chunks)


def test_random_stress_every_request_finishes_exactly_once():
    rng = random.Random(11)
    total_batches = total_preemptions = 0
    for trial in range(12):
        depth = rng.randint(1, 3)
        block_size = rng.choice([1, 4, 16])
        num_blocks = rng.randint(8, 80) if block_size > 1 else rng.randint(40, 300)
        budget = rng.choice([1, 3, 8, 16, 64])
        sched, bm = make(num_blocks=num_blocks, block_size=block_size, max_seqs=rng.randint(1, 12),
                         budget=budget, depth=depth)
        cap = num_blocks * block_size
        seqs = []
        for i in range(rng.randint(30, 120)):
            p = rng.randint(1, min(60, cap - 1))
            o = rng.randint(1, min(40, cap - p))  # a recompute of p + o - 1 tokens fits the cache
            seqs.append(mkseq(i, p, o))
        p_arrive = rng.choice([0.2, 0.6, 1.0])
        log = run_pipelined(sched, bm, seqs, depth=depth, arrivals=lambda step, p=p_arrive: rng.random() < p)
        _check_all_finished(log, seqs, bm)
        assert not sched.running and not sched.waiting
        total_batches += len(log.batches)
        total_preemptions += sched.num_preemptions
    assert total_batches > 3000 and total_preemptions > 0


def test_pipeline_depth_two_splits_decodes_in_halves():
    sched, bm = make(num_blocks=1024, budget=512, max_seqs=64, depth=2)
    seqs = [mkseq(i, 2, 30) for i in range(20)]
    log = run_pipelined(sched, bm, seqs, depth=2)
    _check_all_finished(log, seqs, bm)
    first, second, third = (b for b, _ in log.batches[:3])
    assert first.is_prefill and len(first) == 20  # everything admitted at once (40 tokens <= 512)
    assert not second.is_prefill and not third.is_prefill
    assert len(second) == len(third) == 10
    assert not {s.seq_id for s in second.seqs} & {s.seq_id for s in third.seqs}
    # while all 20 run, every decode micro-batch carries half of them
    assert all(len(b) == 10 for b, _ in log.batches[1:40])
