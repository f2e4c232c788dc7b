"""The `separate` policy driven by a fake executor: no model, deterministic, thousands of steps."""
import random

from tdpipe.config import SchedulerConfig
from tdpipe.core.block_manager import BlockManager
from tdpipe.core.scheduler import make_scheduler
from tdpipe.sampling.params import SamplingParams
from tdpipe.sequence import Sequence


def run_fake(sched, bm, seqs, arrivals=None, max_steps=100_000):
    """Fake executor: every scheduled sequence gets token 7; finishes at its max_tokens."""
    pending = list(seqs)
    finished = []
    kinds = []
    steps = 0
    while pending or sched.has_unfinished():
        while pending and (arrivals is None or arrivals(steps)):
            sched.add(pending.pop(0))
            if arrivals is not None:
                break
        batch = sched.schedule()
        steps += 1
        assert steps < max_steps, "no progress"
        if batch is None:
            assert not sched.has_unfinished() or pending, "stalled with work pending"
            continue
        kinds.append(batch.is_prefill)
        assert len(batch.seqs) == len({s.seq_id for s in batch.seqs})
        assert bm.num_used_blocks <= bm.num_blocks
        if batch.is_prefill:
            assert batch.num_tokens <= sched.config.max_num_batched_tokens or len(batch.seqs) == 1
        for s, n in zip(batch.seqs, batch.num_new_tokens):
            assert len(s.block_table) * bm.block_size >= s.num_computed_tokens + n
        assert len(sched.running) <= sched.config.max_num_seqs
        finished += sched.update_from_output(batch, [7] * len(batch.sampled_rows()))
    return finished, kinds


def make(num_blocks=64, block_size=4, max_seqs=8, max_tokens=64):
    bm = BlockManager(num_blocks, block_size)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens, max_model_len=max_tokens)
    return make_scheduler(cfg, bm), bm


def mkseq(i, prompt, out):
    return Sequence(i, str(i), [1] * prompt, SamplingParams(max_tokens=out), max_tokens=out)


def test_prefill_first_and_never_mixed():
    sched, bm = make()
    seqs = [mkseq(i, 5, 3) for i in range(4)]
    finished, kinds = run_fake(sched, bm, seqs)
    assert kinds[0] is True and kinds[1:] == [False, False]
    assert sorted(s.seq_id for s in finished) == [0, 1, 2, 3]
    bm.check_no_leaks()


def test_limits_respected():
    sched, bm = make(num_blocks=1000, max_seqs=3, max_tokens=12)
    seqs = [mkseq(i, 5, 2) for i in range(7)]
    for s in seqs:
        sched.add(s)
    b = sched.schedule()
    assert b.is_prefill and len(b.seqs) == 2  # 5 + 5 <= 12 < 15


def test_prompt_longer_than_the_budget_runs_alone():
    # separate never chunks: a prompt over max_num_batched_tokens is prefilled whole, alone, not starved
    sched, bm = make(num_blocks=1000, max_seqs=8, max_tokens=12)
    seqs = [mkseq(0, 20, 2), mkseq(1, 30, 2), mkseq(2, 5, 2), mkseq(3, 5, 2)]
    for s in seqs:
        sched.add(s)
    sizes = []
    while (b := sched.schedule()) is not None and b.is_prefill:
        sizes.append(b.num_new_tokens)
        sched.update_from_output(b, [7] * len(b.sampled_rows()))
    assert sizes == [[20], [30], [5, 5]]


def test_preemption_by_recompute_and_everything_finishes():
    # 12 blocks of 4 tokens = 48 token slots; 6 requests of 4 + 20 tokens cannot all run at once
    sched, bm = make(num_blocks=12, block_size=4, max_seqs=6, max_tokens=64)
    seqs = [mkseq(i, 4, 20) for i in range(6)]
    finished, _ = run_fake(sched, bm, seqs)
    assert sorted(s.seq_id for s in finished) == list(range(6))
    assert sched.num_preemptions > 0
    assert all(len(s.output_token_ids) == 20 for s in finished)
    bm.check_no_leaks()


def test_random_arrivals_every_request_finishes_exactly_once():
    rng = random.Random(1)
    for trial in range(5):
        sched, bm = make(num_blocks=rng.randint(20, 80), block_size=rng.choice([1, 4, 16]),
                         max_seqs=rng.randint(1, 16), max_tokens=64)
        cap = bm.num_blocks * bm.block_size
        seqs = []
        for i in range(300):
            p = rng.randint(1, min(30, cap - 1))
            o = rng.randint(1, min(64, cap) - p)  # a recompute prefill of p + o - 1 tokens fits a batch
            seqs.append(mkseq(i, p, o))
        finished, _ = run_fake(sched, bm, seqs, arrivals=lambda step: rng.random() < 0.5)
        ids = [s.seq_id for s in finished]
        assert sorted(ids) == list(range(300)) and len(set(ids)) == 300
        bm.check_no_leaks()
