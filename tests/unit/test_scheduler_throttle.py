"""gLLM Token Throttling (`throttle`) driven by the pipelined fake executor of the hybrid tests."""
import random

import pytest
from test_scheduler_hybrid import _check_all_finished, mkseq, run_pipelined

from tdpipe.core.block_manager import BlockManager
from tdpipe.core.scheduler import ThrottleScheduler, make_scheduler
from tdpipe.core.scheduler.registry import scheduler_config
from tdpipe.core.scheduler.throttle import ThrottleKnobs


def make(num_blocks=256, block_size=4, max_seqs=8, depth=1, **kw):
    bm = BlockManager(num_blocks, block_size)
    cfg = scheduler_config(policy="throttle", max_num_seqs=max_seqs, max_model_len=4096, pipeline_depth=depth, **kw)
    return make_scheduler(cfg, bm), bm


def test_registered_with_the_papers_defaults():
    sched, _ = make()
    assert isinstance(sched, ThrottleScheduler)
    c = sched.knobs
    assert c is sched.config.knobs and sched.config.max_num_batched_tokens == c.max_prefill_tokens + 256
    assert (c.throttle_T, c.max_prefill_tokens, c.min_prefill_tokens, c.kv_thresh) == (8.0, 2048, 32, 0.05)


@pytest.mark.parametrize("field,value", [("throttle_T", 0), ("max_prefill_tokens", 0),
                                         ("min_prefill_tokens", 0), ("kv_thresh", 1.0)])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        ThrottleKnobs(**{field: value})
    with pytest.raises(ValueError, match=field):
        make(**{field: value})


def test_prefill_tokens_follow_eq3():
    # 1000 blocks of 16: plenty of KV. #WP = 10 prompts x 400 = 4000; #WP/#T = 500 < #MaxP x ~1 = 2048
    sched, bm = make(num_blocks=1000, block_size=16, max_seqs=64)
    for i in range(10):
        sched.add(mkseq(i, 400, 4))
    assert sched.prefill_budget(0) == 500
    batch = sched.schedule()
    assert batch.num_tokens == 500
    # KV nearly full: the KV term takes over; below KVthresh no prefill at all
    sched2, bm2 = make(num_blocks=100, block_size=16, max_seqs=64, max_prefill_tokens=1000)
    for i in range(40):
        sched2.add(mkseq(i, 400, 4))
    bm2.free_blocks = type(bm2.free_blocks)(list(bm2.free_blocks)[:30])  # 30% free
    expect = int(1000 * (0.30 - 0.05) / 0.95)
    assert sched2.prefill_budget(0) == max(min(40 * 400 // 8, expect), 32)
    bm2.free_blocks = type(bm2.free_blocks)(list(bm2.free_blocks)[:4])  # 4% free < 5%
    assert sched2.prefill_budget(1) == 0  # decodes run: no prefill below KVthresh
    assert sched2.prefill_budget(0) == 32  # nothing else could run: #MinP keeps the engine moving
    # a short queue still gets #MinP
    sched3, _ = make()
    sched3.add(mkseq(0, 40, 4))
    assert sched3.prefill_budget(0) == 32


def test_decodes_spread_over_the_micro_batches():
    sched, bm = make(num_blocks=1000, block_size=16, max_seqs=64, depth=4)
    seqs = [mkseq(i, 8, 50) for i in range(40)]
    log = run_pipelined(sched, bm, seqs, depth=4)
    decode_sizes = [sum(1 for n in b.num_new_tokens if n == 1) for b, _ in log.batches
                    if all(n == 1 for n in b.num_new_tokens)]
    # 40 decoding requests over 4 micro-batches: #D = 10 each
    assert decode_sizes and max(decode_sizes) == 10
    _check_all_finished(log, seqs, bm)


def test_random_stress_every_request_finishes_exactly_once():
    rng = random.Random(5)
    total = 0
    for _ in range(10):
        depth = rng.randint(1, 4)
        block_size = rng.choice([4, 16])
        num_blocks = rng.randint(12, 80)
        sched, bm = make(num_blocks=num_blocks, block_size=block_size, max_seqs=rng.randint(1, 16), depth=depth,
                         throttle_T=rng.choice([1.0, 4.0, 8.0]), max_prefill_tokens=rng.choice([16, 64, 256]),
                         min_prefill_tokens=rng.choice([1, 8, 16]))
        cap = num_blocks * block_size
        seqs = []
        for i in range(rng.randint(30, 100)):
            p = rng.randint(1, min(80, cap - 1))
            seqs.append(mkseq(i, p, rng.randint(1, min(40, cap - p))))
        p_arrive = rng.choice([0.3, 1.0])
        log = run_pipelined(sched, bm, seqs, depth=depth, arrivals=lambda step, p=p_arrive: rng.random() < p)
        _check_all_finished(log, seqs, bm)
        total += len(log.batches)
    assert total > 1000
