"""The in-process executor (pp = 1) deferred as it is on a GPU: submit() returns before its results are read,
so the engine refills the pipeline before handing a step's tokens back, and with --pipeline-depth 2 keeps two
micro-batches queued. On a CPU the forward still runs inside submit(); what these tests pin is the engine's
side: the same answers (greedy, seeded sampling, logprobs, stop tokens, n > 1 forks) whether the executor is
deferred or not, at depth 1 and 2, and a trace of one event per micro-batch."""
import random

import pytest
import torch
from fake_pipeline import TINY

from tdpipe.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from tdpipe.core.engine import LLMEngine
from tdpipe.executor import local
from tdpipe.sampling.params import SamplingParams


@pytest.fixture(scope="module", autouse=True)
def _keep_torch_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


INIT = local.LocalExecutor.__init__


def engine(monkeypatch, deferred: bool, depth: int | None) -> LLMEngine:
    monkeypatch.setattr(local.LocalExecutor, "__init__", lambda self, runner: INIT(self, runner, deferred=deferred))
    sched = SchedulerConfig(policy="throttle", max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256,
                            pipeline_depth=depth)
    cfg = EngineConfig(dtype="float32", num_threads=torch.get_num_threads(), collect_trace=True,
                       cache=CacheConfig(block_size=4, num_blocks=128, enable_prefix_caching=False),
                       scheduler=sched, parallel=ParallelConfig(pipeline_parallel_size=1))
    eng = LLMEngine.from_config(cfg, hf_config=TINY, seed=3)
    assert eng.executor.asynchronous is deferred
    return eng


def requests() -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(7)
    out = []
    for i in range(10):
        prompt = [rng.randrange(1, TINY["vocab_size"]) for _ in range(rng.randint(2, 20))]
        if i % 3 == 0:
            sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        elif i % 3 == 1:
            sp = SamplingParams(max_tokens=8, temperature=0.8, seed=i, logprobs=2, ignore_eos=True)
        else:
            sp = SamplingParams(max_tokens=8, temperature=0.0, n=2, stop_token_ids=[5], ignore_eos=True)
        out.append((prompt, sp))
    return out


def run(eng: LLMEngine, depth: int = 1) -> dict:
    """Every request's tokens (and logprobs) per sample; `depth` micro-batches were in flight between steps."""
    got: dict = {}
    most = 0
    for i, (p, sp) in enumerate(requests()):
        eng.add_request(str(i), p, sp)
    steps = 0
    while eng.has_unfinished():
        for d in eng.step():
            key = (d.request_id, d.index)
            toks, lps = got.setdefault(key, ([], []))
            toks += d.new_token_ids
            if d.logprobs:
                lps += [[(t, round(v, 4), r) for t, v, r in lp] for lp in d.logprobs]
        steps += 1
        most = max(most, len(eng._inflight))
    assert most == (depth if eng.executor.asynchronous else 0)
    eng.block_manager.check_no_leaks()
    events = eng.trace()["stages"][0]["events"]
    assert len(events) == eng.stats.prefill_steps + eng.stats.decode_steps + eng.stats.mixed_steps
    assert all(e["end"] >= e["start"] for e in events)
    eng.shutdown()
    return got


def test_deferred_results_are_the_same_answers(monkeypatch):
    ref = run(engine(monkeypatch, deferred=False, depth=None))
    assert len(ref) == 13 and all(len(t) >= 1 for t, _ in ref.values())
    assert run(engine(monkeypatch, deferred=True, depth=None)) == ref
    assert run(engine(monkeypatch, deferred=True, depth=2), depth=2) == ref


def test_a_deferred_executor_refills_before_returning_tokens(monkeypatch):
    """Depth 1, deferred: when step() returns, the next micro-batch is already submitted (the caller's work
    on the tokens overlaps the device's); not deferred, nothing is in flight between steps."""
    for deferred in (False, True):
        eng = engine(monkeypatch, deferred=deferred, depth=None)
        eng.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        eng.step()
        assert len(eng._inflight) == (1 if deferred else 0)
        while eng.has_unfinished():
            eng.step()
        eng.shutdown()
