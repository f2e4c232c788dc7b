"""TD-Pipe (`td-pipe`): Algorithm 1, work stealing (Fig. 9), the intensity switch, and long random runs
through the pipelined fake executor of the hybrid tests."""
import random

import pytest
from test_scheduler_hybrid import _check_all_finished, mkseq, run_pipelined

from tdpipe.core.block_manager import BlockManager
from tdpipe.core.scheduler import TDPipeScheduler, make_scheduler
from tdpipe.core.scheduler.registry import scheduler_config
from tdpipe.core.scheduler.td_pipe import Phase, StepCostModel, TDPipeKnobs


def make(num_blocks=256, block_size=4, max_seqs=64, depth=2, budget=64, **kw):
    bm = BlockManager(num_blocks, block_size)
    cfg = scheduler_config(policy="td-pipe", max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                           max_model_len=4096, pipeline_depth=depth, **kw)
    return make_scheduler(cfg, bm), bm


def test_registered_with_future_points():
    sched, _ = make(future_points=(32, 1024))
    assert isinstance(sched, TDPipeScheduler)
    assert sched.future_points[:3] == [32, 64, 96] and sched.future_points[-1] == 1024


def test_knobs_are_the_policys_own():
    sched, _ = make(future_points=[8, 64], work_stealing=False)  # a list (from JSON) is fine
    assert sched.knobs is sched.config.knobs and sched.knobs == TDPipeKnobs((8, 64), work_stealing=False)
    assert make()[0].knobs == TDPipeKnobs()  # the defaults, declared once in TDPipeKnobs
    with pytest.raises(ValueError, match="future_points"):
        make(future_points=(64, 8))
    with pytest.raises(TypeError, match="'throttle_T'"):  # another policy's knob
        make(throttle_T=2.0)


@pytest.mark.parametrize("field,value", [("switch_to_decode", "kv-ratio:2"), ("switch_to_decode", "finish-ratio:0.5"),
                                         ("switch_to_prefill", "kv-ratio:0.5"), ("switch_to_prefill", "bogus")])
def test_bad_switch_rules_name_the_flag(field, value):
    with pytest.raises(ValueError, match=field):
        make(**{field: value})


def test_algorithm1_update_usage_and_would_overflow():
    # 100 blocks of 4 tokens; futurePoints 4, 8, 12
    sched, bm = make(num_blocks=100, block_size=4, future_points=(4, 12))
    s = mkseq(0, 10, 9)
    s.predicted_output_len = 9
    sched.update_usage(s)  # 14 and 18 tokens at points 4 and 8; still decoding after 8, up to 19 tokens
    assert sched.kv_usage == [4, 5, 5]
    s.predicted_output_len = 8  # finishes exactly at point 8: nothing in (8, 12]
    assert sched.seq_usage(s) == [4, 5, 0]
    assert not sched.would_overflow(s, sched.kv_usage, 0)  # 5 + 5 blocks at point 8: fits 100
    sched.kv_usage[1] = 96
    assert sched.would_overflow(s, sched.kv_usage, 0)  # 96 + 5 > 100


def test_greedy_prefill_admits_past_current_capacity_by_prediction():
    # prompts of 8 tokens predicted to stop after 4: the peak stays low, so prefill keeps going until
    # nothing waits, even though max_tokens (64) would not fit
    sched, bm = make(num_blocks=40, block_size=4, future_points=(4, 64), budget=16)
    for i in range(10):
        s = mkseq(i, 8, 64)
        s.predicted_output_len = 4
        sched.add(s)
    batches = []
    while sched.phase is Phase.PREFILL:
        b = sched.schedule()
        if b is None:
            break
        batches.append(b)
    assert sum(len(b) for b in batches if b.is_prefill) == 10


def test_work_stealing_replays_figure_9():
    # 512 requests in 4 batches of 128; batch 0 finishes 48, batch 1 finishes 8 (TD-Pipe Fig. 9)
    sched, bm = make(num_blocks=20000, block_size=16, max_seqs=512, depth=4, budget=1 << 16)
    seqs = [mkseq(i, 4, 1000) for i in range(512)]
    for s in seqs:
        s.predicted_output_len = 100  # the predicted peak fits: all 512 are prefilled before decoding
        sched.add(s)
    b = sched.schedule()  # one prefill batch of all 512
    assert b.is_prefill and len(b) == 512
    for s in b.seqs:
        s.num_computed_tokens += 4
        s.output_token_ids.append(7)
    sched.on_result(b)
    batches = [sched.schedule() for _ in range(4)]
    assert [len(x) for x in batches] == [128] * 4 and sched.phase is Phase.DECODE

    def finish(batch, k):
        for s in batch.seqs[:k]:
            s.status = s.status.FINISHED
        for s in batch.seqs:
            s.num_computed_tokens += 1
            s.output_token_ids.append(7)
        sched.on_result(batch)

    finish(batches[0], 48)
    nb0 = sched.schedule()
    assert len(nb0) == 80  # below the average of 116 (464 / 4): all 80 resubmitted
    finish(batches[1], 8)
    nb1 = sched.schedule()
    assert len(nb1) == 114  # average now 456 / 4 = 114: 6 requests stolen from batch 1
    finish(batches[2], 0)
    nb2 = sched.schedule()
    finish(batches[3], 0)
    nb3 = sched.schedule()
    assert len(nb2) == len(nb3) == 114
    finish(nb0, 0)
    nb4 = sched.schedule()
    assert len(nb4) == 114  # the stolen requests fill batch 0 back up: balanced within the next round


def test_no_work_stealing_keeps_batches_as_they_are():
    sched, bm = make(num_blocks=20000, block_size=16, max_seqs=512, depth=4, budget=1 << 16, work_stealing=False)
    for i in range(512):
        s = mkseq(i, 4, 1000)
        s.predicted_output_len = 100
        sched.add(s)
    b = sched.schedule()
    for s in b.seqs:
        s.num_computed_tokens += 4
        s.output_token_ids.append(7)
    sched.on_result(b)
    batches = [sched.schedule() for _ in range(4)]
    for s in batches[0].seqs[:48]:
        s.status = s.status.FINISHED
    for s in batches[0].seqs:
        s.num_computed_tokens += 1
        s.output_token_ids.append(7)
    sched.on_result(batches[0])
    assert len(sched.schedule()) == 80


def test_intensities():
    sched, bm = make(num_blocks=1000, budget=1000)
    c = StepCostModel(d0=0.01, d1=0.001, p0=0.0, p1=0.001, peak_batch=256)
    sched.costs = c
    assert sched.spatial_intensity(256) == pytest.approx(1.0)
    assert sched.spatial_intensity(16) < sched.spatial_intensity(64) < 1.0
    assert sched.temporal_intensity(16) == 0.0  # nothing waits: no prefill to switch to
    for i in range(4):
        sched.add(mkseq(i, 500, 10))  # 2000 tokens -> batches of 1000 and 1000: 1 s each
    t = sched.temporal_intensity(16)
    bubble = 1.0 - c.decode_time(16)
    assert t == pytest.approx(1 - bubble / (2.0 + 2 * c.decode_time(16) + bubble))


def test_pending_prefills_are_what_the_next_phase_would_admit():
    # 256 blocks of 4 tokens = 1024 tokens: Algorithm 1 (and today's free KV) admit only one 500-token prompt
    # predicted to run 10 steps (its 510 tokens at futurePoints 8 and... are under capacity; two would pass)
    sched, bm = make(num_blocks=256, budget=1000, future_points=(8, 64))
    for i in range(4):
        sched.add(mkseq(i, 500, 10))
    assert sched.pending_prefills() == [1000]  # two prompts fit today's 1024 free tokens (2 x 125 blocks)
    for s in list(sched.waiting):
        s.predicted_output_len = 40  # now two requests' predicted KV at step 8..40 passes 256 blocks
    sched._plan_key = None
    assert sched.pending_prefills() == [500]


def test_reachable_intensity_takes_peak_where_a_switch_can_reach():
    sched, bm = make(num_blocks=256, budget=1000, depth=2, future_points=(8, 64),
                     switch_to_prefill="reachable-intensity")
    c = StepCostModel(d0=0.01, d1=0.0001, p0=0.0, p1=0.0001, peak_batch=256)
    sched.costs = c
    for i in range(4):
        sched.add(mkseq(i, 500, 10))
    for i in range(10):  # ten requests decoding, five per micro-batch
        s = mkseq(10 + i, 4, 8)
        bm.allocate(s)
        s.num_computed_tokens = 4
        sched.running.append(s)
    assert sched.pending_prefills() == [500] and sched._plan_admits == 1  # Algorithm 1 admits one prompt
    assert sched.reachable_batch() == 6  # (10 running + 1 admitted) / 2, rounded up
    # the paper's Peak (batch 256) is unreachable: Eq. 1 alone would call batch 5 inefficient
    assert sched.spatial_intensity(5) < 0.1 < sched.spatial_intensity(5, sched.reachable_batch())
    assert sched.should_prefill(5) == (sched.spatial_intensity(5, 6) < sched.temporal_intensity(5))
    assert not sched.should_prefill(6)  # the switch cannot grow the batch: stay in decode


@pytest.mark.parametrize("rules", [{}, {"switch_to_decode": "kv-ratio:0.5"}, {"switch_to_prefill": "finish-ratio:0.3"},
                                   {"switch_to_prefill": "reachable-intensity"}, {"work_stealing": False}])
def test_random_stress_every_request_finishes_exactly_once(rules):
    rng = random.Random(7)
    total = switches = 0
    for _ in range(8):
        depth = rng.randint(1, 4)
        block_size = rng.choice([4, 16])
        num_blocks = rng.randint(16, 120)
        cap = num_blocks * block_size
        sched, bm = make(num_blocks=num_blocks, block_size=block_size, max_seqs=rng.randint(2, 32), depth=depth,
                         budget=max(64, cap), future_points=(8, 256), **rules)
        seqs = []
        for i in range(rng.randint(40, 120)):
            p = rng.randint(1, min(60, cap // 2))
            s = mkseq(i, p, rng.randint(1, min(60, cap - p)))
            s.predicted_output_len = max(1, int(s.max_tokens * rng.uniform(0.5, 1.5)))  # an imperfect predictor
            seqs.append(s)
        p_arrive = rng.choice([0.3, 1.0])
        log = run_pipelined(sched, bm, seqs, depth=depth, arrivals=lambda step, p=p_arrive: rng.random() < p)
        _check_all_finished(log, seqs, bm)
        total += len(log.batches)
        switches += sched.num_switches
    assert total > 500 and switches > 8
