"""A SamplingParams changed after it was built (RL code clones a template and sets fields per request, as
vLLM's users do): the engine checks the changed fields and uses them. A stop_token_ids set afterwards used to
stop nothing (the stop-token set was derived once, at construction), and a bad value went unchecked."""
import pytest
import torch
from fake_pipeline import TINY

from tdpipe.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from tdpipe.core.engine import LLMEngine
from tdpipe.core.validation import RequestError, RequestLimits, validate_request
from tdpipe.sampling.params import SamplingParams


@pytest.fixture(scope="module", autouse=True)
def _keep_torch_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def engine() -> LLMEngine:
    cfg = EngineConfig(dtype="float32", num_threads=torch.get_num_threads(),
                       cache=CacheConfig(block_size=4, num_blocks=64, enable_prefix_caching=False),
                       scheduler=SchedulerConfig(policy="separate", max_num_seqs=4, max_model_len=128),
                       parallel=ParallelConfig(pipeline_parallel_size=1))
    return LLMEngine.from_config(cfg, hf_config=TINY, seed=2)


def tokens(eng: LLMEngine, params: SamplingParams) -> list[int]:
    eng.add_request("r", [3, 4, 5, 6], params)
    out: list[int] = []
    while eng.has_unfinished():
        out += [t for d in eng.step() for t in d.new_token_ids]
    return out


def test_stop_token_ids_set_after_build_stop_the_request():
    eng = engine()
    free = tokens(eng, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert len(free) == 8
    p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True).clone()
    p.stop_token_ids = [free[2]]  # set on the built object
    assert tokens(eng, p) == free[: free.index(free[2]) + 1]
    eng.shutdown()


def test_a_bad_value_set_after_build_is_refused_naming_it():
    eng = engine()
    p = SamplingParams(temperature=0.0)
    p.top_p = 0.0
    with pytest.raises(ValueError, match="top_p"):
        eng.add_request("bad", [3, 4], p)
    assert not eng.has_unfinished()
    p.top_p, p.stop = 1.0, "x"  # a bare string set afterwards is the one-string list, as at construction
    limits = RequestLimits(max_model_len=128, vocab_size=TINY["vocab_size"], max_num_seqs=4)
    validate_request("ok", [3, 4], p, limits)
    assert p.stop == ["x"]
    p.n = 0
    with pytest.raises(RequestError) as e:
        validate_request("bad", [3, 4], p, limits)
    assert e.value.param == "n"
    eng.shutdown()


def test_unchanged_params_are_not_checked_again():
    """revalidate() runs the checks only after a field was set: a 5,000-id allowed_token_ids list shared by
    many requests is checked once, not once per request."""
    p = SamplingParams(allowed_token_ids=list(range(5000)))
    calls = []
    check = SamplingParams.__post_init__
    try:
        SamplingParams.__post_init__ = lambda self: (calls.append(1), check(self))[1]
        p.revalidate()
        p.revalidate()
        assert calls == []
        p.allowed_token_ids = [7, 3]
        p.revalidate()
        assert calls == [1] and p.allowed_token_ids == [3, 7]
        p.revalidate()
        assert calls == [1]
    finally:
        SamplingParams.__post_init__ = check
