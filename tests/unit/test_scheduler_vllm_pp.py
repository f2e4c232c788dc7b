"""`vllm-pp`: vLLM 0.5.3's virtual engines (core/scheduler/vllm_pp.py). Requests are bound to one micro-batch
slot for life, each slot has its own share of the KV cache and of max_num_seqs, and a micro-batch carries one
slot's requests only, so slots drift apart as requests finish. Unit tests of the binding and admission, the
real engine loop over the fake pipeline (every request finishes once, no leaks, FIFO within a slot), and one
run through a tiny random-weight model in memory."""
import random

import pytest
import torch
from fake_pipeline import TINY, TimedFakeExecutor, check_batch, draw_kv_workload
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tdpipe.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from tdpipe.core.block_manager import BlockManager
from tdpipe.core.engine import LLMEngine
from tdpipe.core.scheduler import make_scheduler
from tdpipe.core.scheduler.registry import scheduler_config
from tdpipe.core.scheduler.vllm_pp import VllmPPKnobs, VllmPPScheduler
from tdpipe.sampling.params import SamplingParams
from tdpipe.sequence import Sequence


@pytest.fixture(scope="module", autouse=True)
def _keep_torch_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def sched(num_blocks=400, block_size=4, depth=4, max_seqs=64, budget=1000, **knobs) -> VllmPPScheduler:
    cfg = scheduler_config(policy="vllm-pp", max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                           max_model_len=1 << 16, pipeline_depth=depth, **knobs)
    return make_scheduler(cfg, BlockManager(num_blocks, block_size))


_ids = iter(range(10**9))


def seq(prompt: int, out: int = 8) -> Sequence:
    i = next(_ids)
    return Sequence(i, str(i), [1] * prompt, SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True),
                    max_tokens=out)


def finish(s: VllmPPScheduler, batch) -> list:
    """Run a batch: every row gets token 7."""
    return s.update_from_output(batch, [7] * len(batch.sampled_rows()))


def test_fewest_unfinished_binding_is_round_robin_then_refills_the_emptiest_slot():
    """vLLM 0.5.3's add_request: the scheduler with the fewest unfinished requests, ties to the lowest index."""
    s = sched(depth=4)
    seqs = [seq(8) for _ in range(10)]
    for x in seqs:
        s.add(x)
    assert [s.slot_of[x.seq_id] for x in seqs] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert s.bound == [3, 3, 2, 2] and len(s.waiting) == 10 and list(s.waiting)[0] is seqs[0]
    s.abort(seqs[0])
    s.abort(seqs[4])  # slot 0 now has one unfinished request, the fewest
    assert s.bound == [1, 3, 2, 2]
    late = seq(8)
    s.add(late)
    assert s.slot_of[late.seq_id] == 0 and s.bound == [2, 3, 2, 2]


def test_most_free_kv_binding_counts_held_and_queued_blocks():
    s = sched(num_blocks=400, block_size=4, depth=2, slot_binding="most-free-kv")  # 200 blocks per slot
    big, small = seq(400), seq(8)  # 100 blocks, 2 blocks
    s.add(big)
    s.add(small)
    assert s.slot_of[big.seq_id] == 0 and s.slot_of[small.seq_id] == 1  # slot 0 has 100 queued
    nxt = seq(8)
    s.add(nxt)
    assert s.slot_of[nxt.seq_id] == 1  # 198 free against 100
    with pytest.raises(ValueError, match="slot_binding"):
        VllmPPKnobs(slot_binding="round-robin")


def test_each_micro_batch_is_one_slot_and_slots_take_turns_in_return_order():
    s = sched(depth=2)
    seqs = [seq(8, out=3) for _ in range(4)]  # slots 0,1,0,1
    for x in seqs:
        s.add(x)
    b0 = s.schedule()
    b1 = s.schedule()
    assert s.schedule() is None  # both slots have a micro-batch in flight
    assert [x.seq_id for x in b0.seqs] == [seqs[0].seq_id, seqs[2].seq_id] and b0.is_prefill
    assert [x.seq_id for x in b1.seqs] == [seqs[1].seq_id, seqs[3].seq_id]
    finish(s, b0)
    b2 = s.schedule()  # slot 0 is back first: its decodes
    assert not b2.is_prefill and set(b2.seqs) == {seqs[0], seqs[2]}
    finish(s, b1)
    finish(s, b2)
    b3 = s.schedule()  # slot 1 came back before slot 0 did
    assert set(b3.seqs) == {seqs[1], seqs[3]}


def test_each_slot_owns_its_share_of_kv_and_of_max_num_seqs():
    """400 blocks, 2 slots: 200 each (minus vLLM's 1% watermark: 2); max_num_seqs 6: 3 each."""
    s = sched(num_blocks=400, block_size=4, depth=2, max_seqs=6, budget=100_000)
    assert s.quota == [200, 200] and s.max_seqs == [3, 3] and s.slot_watermark == [2, 2]
    a = [seq(4 * 60) for _ in range(6)]  # 60 blocks each: three fit one slot's 198
    for x in a:
        s.add(x)
    b0 = s.schedule()
    assert len(b0.seqs) == 3 and sum(len(x.block_table) for x in b0.seqs) == 180
    s2 = sched(num_blocks=400, block_size=4, depth=2, max_seqs=64, budget=100_000)
    for x in [seq(4 * 70) for _ in range(6)]:  # 70 blocks each: two per slot, the third waits for its own slot
        s2.add(x)
    b = s2.schedule()
    assert len(b.seqs) == 2 and s2.bm.num_free_blocks == 400 - 140
    assert len(s2.schedule().seqs) == 2  # slot 1: its own share, although slot 0's third would fit the pool


def test_decode_preempts_the_newest_of_its_own_slot_only():
    """Slot 0's share runs out while the pool has room: slot 0 preempts its own newest request (recompute),
    as each of vLLM's schedulers did in its own block manager."""
    s = sched(num_blocks=40, block_size=4, depth=2, max_seqs=8, budget=1000)  # 20 blocks per slot, no watermark
    a, b, c = seq(40, out=50), seq(8, out=50), seq(40, out=50)  # 10, 2, 10 blocks
    for x in (a, b, c):
        s.add(x)
    assert [s.slot_of[x.seq_id] for x in (a, b, c)] == [0, 1, 0]
    b0 = s.schedule()
    assert b0.seqs == [a, c]  # exactly slot 0's share
    b1 = s.schedule()
    assert b1.seqs == [b]
    finish(s, b0)  # a and c now hold 41 tokens: their next token needs an 11th block each
    d = s.schedule()
    assert d.seqs == [a] and s.num_preemptions == 1 and list(s.waiting.queues[0]) == [c]
    assert s.bm.num_free_blocks == 40 - 11 - 2  # the pool had room; slot 0's share did not
    assert b.block_table and b in s.running  # slot 1 untouched


def test_a_request_larger_than_one_share_runs_alone():
    s = sched(num_blocks=40, block_size=4, depth=2, max_seqs=8, budget=1000)  # 20 blocks per slot
    big = seq(4 * 30, out=4)  # 30 blocks: more than a share, less than the pool
    s.add(big)
    b = s.schedule()
    assert b.seqs == [big] and len(big.block_table) == 30


def engine_config(num_blocks, block_size, max_seqs, pp, depth=None, budget=None, **knobs) -> EngineConfig:
    sc = SchedulerConfig(policy="vllm-pp", max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                         max_model_len=num_blocks * block_size, pipeline_depth=depth, knobs=knobs or None)
    return EngineConfig(dtype="float32", num_threads=torch.get_num_threads(),
                        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=False),
                        scheduler=sc, parallel=ParallelConfig(pipeline_parallel_size=pp))


def run_fake(lengths, num_blocks, block_size, max_seqs, pp, depth=None, budget=None, **knobs):
    """The real engine loop over the fake pipeline; checks each batch (the shared checks, plus: one slot per
    micro-batch, a slot within its KV share unless one request runs alone). Returns (engine, seqs, batches)."""
    engine = LLMEngine.from_config(engine_config(num_blocks, block_size, max_seqs, pp, depth, budget, **knobs),
                                   executor_factory=lambda parts: TimedFakeExecutor(pp), hf_config=TINY)
    engine.executor.reset()
    s, bm = engine.scheduler, engine.block_manager
    schedule, batches, admitted = s.schedule, [], []

    def checked():
        in_flight = {x.seq_id for b in engine._inflight for x in b.seqs}
        batch = schedule()
        if batch is not None:
            check_batch(s, bm, batch, in_flight)
            slots = {s.slot_of[x.seq_id] for x in batch.seqs}
            assert len(slots) == 1, "a micro-batch mixed two virtual engines"
            slot = slots.pop()
            mine = s.slot_running()[slot]
            held = sum(len(x.block_table) for x in mine)
            assert held <= s.quota[slot] or len(mine) == 1, "a slot past its KV share"
            assert sum(x.num_samples_pending for x in mine) <= s.max_seqs[slot]
            batches.append((slot, batch.is_prefill, len(batch.seqs)))
            admitted.extend((slot, x.seq_id) for x in batch.seqs if batch.is_prefill and x.num_preemptions == 0
                            and (slot, x.seq_id) not in admitted)
        return batch

    s.schedule = checked
    seqs = [engine.add_request(str(i), [1] * p, SamplingParams(max_tokens=o, temperature=0.0))
            for i, (p, o) in enumerate(lengths)]
    steps = 0
    finished = []
    while engine.has_unfinished():
        steps += 1
        assert steps < 200_000, "no progress"
        finished += [d.request_id for d in engine.step() if d.finished]
    assert sorted(finished, key=int) == [str(i) for i in range(len(lengths))]
    assert all(x.num_output_tokens == x.max_tokens for x in seqs)
    bm.check_no_leaks()
    assert bm.num_used_blocks == 0 and s.bound == [0] * s.num_slots and not s.slot_of
    for slot in range(s.num_slots):  # FIFO within each virtual engine (vLLM's per-scheduler FCFS)
        order = [i for v, i in admitted if v == slot]
        assert order == sorted(order), f"slot {slot} admitted out of order"
    return engine, seqs, batches


@st.composite
def scenario(draw):
    block_size, num_blocks, lengths = draw_kv_workload(draw, max_requests=30, max_output=60)
    return dict(block_size=block_size, num_blocks=num_blocks, lengths=lengths, max_seqs=draw(st.integers(1, 24)),
                pp=draw(st.integers(1, 4)), depth=draw(st.sampled_from([None, None, 1, 3, 5])),
                binding=draw(st.sampled_from(["fewest-unfinished", "most-free-kv"])),
                budget=draw(st.sampled_from([None, 16, 64])))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenario())
def test_every_request_finishes_once_in_the_engine_loop(sc):
    run_fake(sc["lengths"], sc["num_blocks"], sc["block_size"], sc["max_seqs"], sc["pp"], sc["depth"], sc["budget"],
             slot_binding=sc["binding"])


def test_slots_drift_apart_where_separate_stays_balanced():
    """The point of the baseline: with the same requests, vllm-pp's decode micro-batches differ in size (a
    slot whose requests finished early runs small batches, then none) where `separate` splits evenly."""
    rng = random.Random(4)
    lengths = [(rng.randint(10, 60), rng.choice([5, 10, 120])) for _ in range(64)]
    _, _, batches = run_fake(lengths, num_blocks=2000, block_size=4, max_seqs=64, pp=4)
    decodes = [n for _, pre, n in batches if not pre]
    window = [decodes[i:i + 4] for i in range(0, len(decodes) - 3, 4)]
    spread = sum(max(w) - min(w) for w in window) / len(window)
    assert spread > 3  # micro-batches of one round differ by several requests on average
    sep = LLMEngine.from_config(dataclass_replace_policy(engine_config(2000, 4, 64, 4), "separate"),
                                executor_factory=lambda parts: TimedFakeExecutor(4), hf_config=TINY)
    sizes = []
    schedule = sep.scheduler.schedule

    def rec():
        b = schedule()
        if b is not None and not b.is_prefill:
            sizes.append(len(b.seqs))
        return b

    sep.scheduler.schedule = rec
    for i, (p, o) in enumerate(lengths):
        sep.add_request(str(i), [1] * p, SamplingParams(max_tokens=o, temperature=0.0))
    while sep.has_unfinished():
        sep.step()
    sep_window = [sizes[i:i + 4] for i in range(0, len(sizes) - 3, 4)]
    assert sum(max(w) - min(w) for w in sep_window) / len(sep_window) < spread


def dataclass_replace_policy(cfg: EngineConfig, policy: str) -> EngineConfig:
    cfg.scheduler.policy, cfg.scheduler.knobs, cfg.scheduler.max_num_batched_tokens = policy, None, None
    return cfg


def test_on_a_random_weight_model_with_two_virtual_engines():
    """The real engine and a tiny random-weight model (pp 1, two micro-batches in flight: two virtual engines):
    the greedy answers are the ones `separate` gives."""
    prompts = [[random.Random(i).randrange(1, TINY["vocab_size"]) for _ in range(3 + i % 7)] for i in range(10)]

    def answers(policy, depth):
        cfg = engine_config(64, 4, 8, 1, depth=depth, budget=16)
        if policy != "vllm-pp":
            cfg = dataclass_replace_policy(cfg, policy)
        engine = LLMEngine.from_config(cfg, hf_config=TINY, seed=1)
        out = {str(i): [] for i in range(len(prompts))}
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished():
            for d in engine.step():
                out[d.request_id] += d.new_token_ids
        engine.block_manager.check_no_leaks()
        if policy == "vllm-pp":
            assert engine.scheduler.num_slots == depth and not engine.scheduler.slot_of
        engine.shutdown()
        return out

    got = answers("vllm-pp", 2)
    assert all(len(v) == 5 for v in got.values())
    assert got == answers("separate", 1)


def test_a_request_with_more_samples_than_a_slots_share_still_runs():
    """max_num_seqs 4 over 4 slots is one sequence each; an n = 3 request runs alone in its slot."""
    s = sched(depth=4, max_seqs=4)
    x = Sequence(next(_ids), "n3", [1] * 8, SamplingParams(n=3, max_tokens=4, temperature=1.0), max_tokens=4)
    s.add(x)
    b = s.schedule()
    assert b is not None and b.seqs == [x]


def test_abort_frees_blocks_and_the_binding():
    s = sched(depth=2)
    a, b, c = seq(8), seq(8), seq(8)
    for x in (a, b, c):
        s.add(x)
    batch = s.schedule()  # slot 0: a and c
    finish(s, batch)
    s.abort(c)  # running, idle
    s.abort(b)  # waiting in slot 1
    assert s.bound == [1, 0] and c.seq_id not in s.slot_of and not c.block_table and not s.waiting.queues[1]
    s.abort(a)
    assert s.bm.num_free_blocks == s.bm.num_blocks and s.bound == [0, 0] and not s.has_unfinished()
