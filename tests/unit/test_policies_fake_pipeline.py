"""All four policies through the real engine loop (LLMEngine.step) over a fake pipelined executor with
deterministic step costs (tests/fake_pipeline.py; the engine is built from an in-memory model config, no
folder): random arrivals and lengths; every request finishes exactly once, KV never passes capacity, FIFO
admission (nothing starves). Property-based with hypothesis, plus one long run per policy; and the four
policies once through a tiny model with random weights, built in memory, end to end."""
import random
from collections import deque

import pytest
import torch
from fake_pipeline import TINY, TimedFakeExecutor, check_outcome, draw_kv_workload, watch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tdpipe.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from tdpipe.core.engine import LLMEngine
from tdpipe.sampling.params import SamplingParams

POLICIES = ["separate", "hybrid", "throttle", "td-pipe"]


@pytest.fixture(scope="module", autouse=True)
def _keep_torch_threads():
    """LLMEngine sets torch's (process-wide) thread count; give the tests after these their own back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def config(policy, num_blocks, block_size, max_seqs, pp, budget=None, predictor="auto", depth=None,
           **knobs) -> EngineConfig:
    if policy == "td-pipe":
        knobs = {"future_points": (8, 512), **knobs}
    sched = SchedulerConfig(policy=policy, max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                            max_model_len=num_blocks * block_size, predictor=predictor, pipeline_depth=depth,
                            knobs=knobs or None)
    return EngineConfig(dtype="float32", num_threads=torch.get_num_threads(),
                        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=False),
                        scheduler=sched,
                        parallel=ParallelConfig(pipeline_parallel_size=pp))


def build(policy, num_blocks, block_size, max_seqs, pp, **kw) -> LLMEngine:
    """The real engine over the fake pipeline: a tiny in-memory model config (no weights are computed)."""
    engine = LLMEngine.from_config(config(policy, num_blocks, block_size, max_seqs, pp, **kw),
                                   executor_factory=lambda parts: TimedFakeExecutor(pp), hf_config=TINY)
    engine.executor.reset()
    return engine


def run(engine, lengths, gaps, predicted=None, max_steps=500_000):
    """Requests (prompt, output lengths) arrive after the given gaps (simulated seconds); the engine steps
    until all finished. Returns (watch, finished sequences, sequences, engine steps)."""
    w = watch(engine)
    t = engine.clock()
    pending = deque()
    for i, ((p, o), g) in enumerate(zip(lengths, gaps)):
        t += g
        pending.append((t, str(i), p, o))
    seqs, finished, steps = {}, [], 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= engine.clock():
            _, rid, p, o = pending.popleft()
            seqs[rid] = engine.add_request(rid, [1] * p, SamplingParams(max_tokens=o, temperature=0.0))
            if predicted is not None:  # a predictor off by `predicted`
                seqs[rid].predicted_output_len = max(1, round(o * predicted))
        if not engine.has_unfinished():
            engine.executor.clock = max(engine.executor.clock, pending[0][0])
            continue
        steps += 1
        assert steps < max_steps, "no progress"
        finished += [seqs[d.request_id] for d in engine.step() if d.finished]
    return w, finished, list(seqs.values()), steps


@st.composite
def scenario(draw):
    block_size, num_blocks, lengths = draw_kv_workload(draw, max_requests=40, max_output=80)
    n = len(lengths)
    gaps = draw(st.lists(st.sampled_from([0.0, 0.0, 0.5, 3.0, 20.0]), min_size=n, max_size=n))
    return dict(block_size=block_size, num_blocks=num_blocks, lengths=lengths, gaps=gaps,
                max_seqs=draw(st.integers(1, 24)), pp=draw(st.integers(1, 4)),
                depth=draw(st.sampled_from([None, None, 1, 2, 3, 5])))  # micro-batches in flight


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenario(), extra=st.sampled_from([{}, {"budget": 16}, {"budget": 64}]))
def test_every_policy_finishes_everything_once(policy, sc, extra):
    engine = build(policy, sc["num_blocks"], sc["block_size"], sc["max_seqs"], sc["pp"], depth=sc["depth"],
                   **extra)
    w, finished, seqs, _ = run(engine, sc["lengths"], sc["gaps"])
    check_outcome(w, finished, seqs, engine.block_manager)


@pytest.mark.parametrize("rules", [{}, {"switch_to_decode": "kv-ratio:0.5"}, {"switch_to_prefill": "finish-ratio:0.3"},
                                   {"work_stealing": False}, {"predictor": "constant"}])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenario(), factor=st.floats(0.2, 3.0))
def test_td_pipe_ablations_and_wrong_predictions(rules, sc, factor):
    rules = dict(rules)
    constant = rules.pop("predictor", None)
    engine = build("td-pipe", sc["num_blocks"], sc["block_size"], sc["max_seqs"], sc["pp"],
                   predictor=constant or "auto", **rules)
    w, finished, seqs, _ = run(engine, sc["lengths"], sc["gaps"], predicted=None if constant else factor)
    check_outcome(w, finished, seqs, engine.block_manager)


@pytest.mark.parametrize("policy", POLICIES)
def test_thousands_of_steps_under_kv_pressure(policy):
    """A long ShareGPT-shaped run where not all requests fit at once."""
    rng = random.Random(11)
    lengths = [(min(300, int(rng.lognormvariate(3.5, 0.8)) + 1), min(200, int(rng.lognormvariate(3.3, 0.8)) + 1))
               for _ in range(1000)]
    gaps = [rng.choice([0.0, 0.0, 0.2, 2.0]) for _ in lengths]
    engine = build(policy, num_blocks=120, block_size=16, max_seqs=32, pp=2, predictor="oracle")
    w, finished, seqs, steps = run(engine, lengths, gaps)
    bm = engine.block_manager
    check_outcome(w, finished, seqs, bm)
    assert steps > 2000
    assert w.max_used_blocks > 0.8 * bm.num_blocks  # the cache really was the constraint
    if policy == "td-pipe":  # oracle lengths: never over capacity
        assert engine.scheduler.num_switches >= 4 and engine.scheduler.num_preemptions == 0


@pytest.mark.parametrize("pp,depth", [(2, None), (2, 3), (3, 4), (1, 2)])
def test_the_engine_keeps_pipeline_depth_micro_batches_in_flight(pp, depth):
    """--pipeline-depth: up to that many micro-batches in flight (default: one per stage), and the running
    requests split over them (decode batches of ceil(running / depth))."""
    engine = build("throttle", num_blocks=400, block_size=16, max_seqs=64, pp=pp, depth=depth, predictor="oracle")
    want = depth or pp
    assert engine.scheduler.config.pipeline_depth == want
    most, submit = [0], engine.executor.submit

    def counted(step):
        submit(step)
        most[0] = max(most[0], len(engine._inflight) + 1)  # the batch being submitted is appended after

    engine.executor.submit = counted
    w, finished, seqs, _ = run(engine, [(20, 40)] * 48, [0.0] * 48)
    check_outcome(w, finished, seqs, engine.block_manager)
    assert most[0] == want
    assert engine.scheduler.decode_batch_cap() >= 1


def test_td_pipe_has_fewer_bubbles_than_separate_in_the_fake_pipeline():
    """Not a speed test: in simulated time with the same deterministic costs, td-pipe's phases keep the
    pipeline fuller than interleaving single prefill batches with decodes (TD-Pipe §2.3, Fig. 3)."""
    rng = random.Random(3)
    lengths = [(rng.randint(20, 200), rng.randint(10, 150)) for _ in range(300)]
    ratios = {}
    for policy in ("separate", "td-pipe"):
        engine = build(policy, num_blocks=400, block_size=16, max_seqs=128, pp=4, predictor="oracle")
        w, finished, seqs, _ = run(engine, lengths, [0.0] * len(lengths))
        check_outcome(w, finished, seqs, engine.block_manager)
        ratios[policy] = engine.executor.bubble_ratio()
    assert ratios["td-pipe"] < ratios["separate"]


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_on_a_random_weight_model_in_memory(policy):
    """The same loop over a real (tiny, random-weight) model built in memory: no folder, no tokenizer; the
    greedy answer of a request does not depend on the policy that batched it."""
    cfg = config(policy, num_blocks=64, block_size=4, max_seqs=8, pp=1, budget=16)
    engine = LLMEngine.from_config(cfg, hf_config=TINY, seed=1)
    assert engine.tokenizer is None and engine.model_config.vocab_size == TINY["vocab_size"]
    rng = random.Random(5)
    prompts = [[rng.randrange(1, TINY["vocab_size"]) for _ in range(rng.randint(1, 30))] for _ in range(12)]
    out = {str(i): [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        for d in engine.step():
            out[d.request_id] += d.new_token_ids
    assert all(len(v) == 6 for v in out.values())
    engine.block_manager.check_no_leaks()
    engine.shutdown()
    alone = LLMEngine.from_config(config("separate", 64, 4, 1, 1), hf_config=TINY, seed=1)
    alone.add_request("x", prompts[3], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    ref = []
    while alone.has_unfinished():
        ref += [t for d in alone.step() for t in d.new_token_ids]
    assert ref == out["3"]


def test_abort_takes_request_ids_and_samples_apart():
    """abort_request takes request ids only; one sample of an n > 1 request is abort_samples' (its group
    cancels a sample not forked yet, so it never runs)."""
    engine = build("separate", num_blocks=64, block_size=4, max_seqs=8, pp=1)
    engine.add_request("r", [1, 2, 3], SamplingParams(n=3, temperature=0.0, max_tokens=4))
    with pytest.raises(TypeError, match="abort_samples"):
        engine.abort_request([("r", 1)])
    assert engine.abort_samples([("r", 2)], reason="abort") == []  # not forked yet: cancelled
    got: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for d in engine.step():
            got.setdefault(d.index, []).extend(d.new_token_ids)
    assert sorted(got) == [0, 1] and "r" not in engine.requests
    engine.block_manager.check_no_leaks()


@pytest.mark.parametrize("bad, field", [(dict(repetition_penalty=1e-50), "repetition_penalty"),
                                        (dict(temperature=1e39), "temperature"),
                                        (dict(stop_token_ids=list(range(300))), "stop_token_ids"),
                                        (dict(stop=["x"] * 100), "stop")])
def test_engine_refuses_what_breaks_float32_or_the_stop_caps(bad, field):
    """Direct LLMEngine users (LLM included) get the frontend's float32 range and stop caps too: valid as
    float64, 1e-50 is 0.0 in the sampler's float32 logits; nothing is queued then."""
    engine = build("separate", num_blocks=64, block_size=4, max_seqs=8, pp=1)
    with pytest.raises(ValueError, match=field):
        engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4, **bad))
    assert not engine.has_unfinished() and "r" not in engine.requests


def test_stop_token_ids_are_looked_up_in_a_set():
    p = SamplingParams(stop_token_ids=[5, 7, 5])
    assert p.stop_token_ids == [5, 7, 5] and p.stop_token_set == frozenset({5, 7})
    assert "stop_token_set" not in __import__("dataclasses").asdict(p)  # the history records fields only
