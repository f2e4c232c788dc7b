"""All four policies through the fake pipelined executor with deterministic step costs (no model):
random arrivals and lengths; every request finishes exactly once, KV never passes capacity, FIFO admission
(nothing starves). Property-based with hypothesis, plus one long run per policy."""
import random

import pytest
from fake_pipeline import check_outcome, run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tdpipe.config import SchedulerConfig
from tdpipe.core.block_manager import BlockManager
from tdpipe.core.predictor import ConstantPredictor, OraclePredictor
from tdpipe.core.scheduler import make_scheduler
from tdpipe.sampling.params import SamplingParams
from tdpipe.sequence import Sequence

POLICIES = ["separate", "hybrid", "throttle", "td-pipe"]


def build(policy, num_blocks, block_size, max_seqs, pp, budget=None, predictor=None, **kw):
    bm = BlockManager(num_blocks, block_size)
    cfg = SchedulerConfig(policy=policy, max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                          max_model_len=num_blocks * block_size, pipeline_depth=pp,
                          future_point_step=8, future_point_max=512, **kw)
    return make_scheduler(cfg, bm, predictor=predictor), bm


def requests(lengths, gaps):
    seqs, arrivals, t = [], [], 0.0
    for i, ((p, o), g) in enumerate(zip(lengths, gaps)):
        seqs.append(Sequence(i, str(i), [1] * p, SamplingParams(max_tokens=o), max_tokens=o))
        t += g
        arrivals.append(t)
    return seqs, arrivals


@st.composite
def scenario(draw):
    block_size = draw(st.sampled_from([1, 4, 16]))
    num_blocks = draw(st.integers(8, 96))
    cap = num_blocks * block_size
    n = draw(st.integers(1, 40))
    lengths = []
    for _ in range(n):
        p = draw(st.integers(1, max(1, cap // 2)))
        lengths.append((p, draw(st.integers(1, max(1, min(80, cap - p))))))
    gaps = draw(st.lists(st.sampled_from([0.0, 0.0, 0.5, 3.0, 20.0]), min_size=n, max_size=n))
    return dict(block_size=block_size, num_blocks=num_blocks, lengths=lengths, gaps=gaps,
                max_seqs=draw(st.integers(1, 24)), pp=draw(st.integers(1, 4)))


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenario(), extra=st.sampled_from([{}, {"budget": 16}, {"budget": 64}]))
def test_every_policy_finishes_everything_once(policy, sc, extra):
    sched, bm = build(policy, sc["num_blocks"], sc["block_size"], sc["max_seqs"], sc["pp"], **extra)
    seqs, arrivals = requests(sc["lengths"], sc["gaps"])
    log = run(sched, bm, seqs, arrivals, sc["pp"])
    check_outcome(log, seqs, bm)


@pytest.mark.parametrize("rules", [{}, {"switch_to_decode": "kv-ratio:0.5"}, {"switch_to_prefill": "finish-ratio:0.3"},
                                   {"work_stealing": False}, {"predictor": "constant"}])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenario(), factor=st.floats(0.2, 3.0))
def test_td_pipe_ablations_and_wrong_predictions(rules, sc, factor):
    rules = dict(rules)
    predictor = ConstantPredictor() if rules.pop("predictor", None) else None
    sched, bm = build("td-pipe", sc["num_blocks"], sc["block_size"], sc["max_seqs"], sc["pp"],
                      predictor=predictor, **rules)
    seqs, arrivals = requests(sc["lengths"], sc["gaps"])
    if predictor is None:
        for s in seqs:  # a predictor off by `factor`
            s.predicted_output_len = max(1, round(s.max_tokens * factor))
    log = run(sched, bm, seqs, arrivals, sc["pp"])
    check_outcome(log, seqs, bm)


@pytest.mark.parametrize("policy", POLICIES)
def test_thousands_of_steps_under_kv_pressure(policy):
    """A long ShareGPT-shaped run where not all requests fit at once."""
    rng = random.Random(11)
    lengths = [(min(300, int(rng.lognormvariate(3.5, 0.8)) + 1), min(200, int(rng.lognormvariate(3.3, 0.8)) + 1))
               for _ in range(1000)]
    gaps = [rng.choice([0.0, 0.0, 0.2, 2.0]) for _ in lengths]
    sched, bm = build(policy, num_blocks=120, block_size=16, max_seqs=32, pp=2, budget=None,
                      predictor=OraclePredictor())
    seqs, arrivals = requests(lengths, gaps)
    log = run(sched, bm, seqs, arrivals, pp=2)
    check_outcome(log, seqs, bm)
    assert log.steps > 2000
    assert log.max_used_blocks > 0.8 * bm.num_blocks  # the cache really was the constraint
    if policy == "td-pipe":
        assert sched.num_switches >= 4 and sched.num_preemptions == 0  # oracle lengths: never over capacity


def test_td_pipe_has_fewer_bubbles_than_separate_in_the_fake_pipeline():
    """Not a speed test: in simulated time with the same deterministic costs, td-pipe's phases keep the
    pipeline fuller than interleaving single prefill batches with decodes (TD-Pipe §2.3, Fig. 3)."""
    rng = random.Random(3)
    lengths = [(rng.randint(20, 200), rng.randint(10, 150)) for _ in range(300)]
    ratios = {}
    for policy in ("separate", "td-pipe"):
        sched, bm = build(policy, num_blocks=400, block_size=16, max_seqs=128, pp=4, predictor=OraclePredictor())
        seqs, arrivals = requests(lengths, [0.0] * len(lengths))
        log = run(sched, bm, seqs, arrivals, pp=4)
        check_outcome(log, seqs, bm)
        ratios[policy] = log.bubble_ratio()
    assert ratios["td-pipe"] < ratios["separate"]
