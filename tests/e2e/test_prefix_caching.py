"""Automatic prefix caching: a cached prefix gives the same tokens as computing it (fp32), at pp = 1 and 2 and
under every policy; hits are counted; nothing leaks. These run the tiny random Qwen2 (the bundled model's
tokenizer, so the same prompts make the same blocks): their point is the cache, the scheduler and the
pipeline, not the answers; the last test checks the bundled model against transformers with caching on."""
import pytest

from tdpipe import LLM, SamplingParams

SYSTEM = ("You are a careful assistant. Answer briefly and exactly. Think about units, dates and names, and say "
          "when you do not know. The user asks questions about geography, history and arithmetic. ") * 3
QUESTIONS = ["What is the capital of Italy?", "How many days are in a leap year?", "Who wrote Hamlet?",
             "What is 12 times 12?", "Name a river in Egypt.", "When did the second world war end?"]


def _greedy(n=16):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _run(model: str, policy: str, pp: int, caching: bool, prompts: list[str],
         **kw) -> tuple[list[list[int]], dict]:
    n_out = kw.pop("n_out", 16)
    llm = LLM(model=model, dtype="float32", num_kv_blocks=kw.pop("num_kv_blocks", 256), scheduler=policy,
              pipeline_parallel_size=pp, enable_prefix_caching=caching, predictor="oracle", **kw)
    try:
        first = llm.generate(prompts[:1], _greedy(n_out), use_tqdm=False)  # caches the shared prefix
        rest = llm.generate(prompts[1:], _greedy(n_out), use_tqdm=False)
        bm = llm.engine.block_manager
        stats = bm.prefix_cache_stats() | {"preemptions": llm.engine.scheduler.num_preemptions,
                                           "cached_tokens": [o.num_cached_tokens for o in first + rest]}
        bm.check_no_leaks()
        return [o.outputs[0].token_ids for o in first + rest], stats
    finally:
        llm.shutdown()


PROMPTS = [SYSTEM + q for q in QUESTIONS]
# a 10-block cache: requests evict each other's cached blocks and are preempted
TIGHT_PROMPTS = [SYSTEM[: 120 + 40 * i] + q for i, q in enumerate(QUESTIONS)]
TIGHT = dict(num_kv_blocks=10, max_model_len=160, n_out=32)


@pytest.fixture(scope="module")
def uncached(qwen2_tiny_path):
    """The reference for every policy and pp: the prompts computed without caching, once per module (greedy
    float32 tokens do not depend on the policy or pp: tests/e2e/test_pipeline.py)."""
    return _run(qwen2_tiny_path, "separate", 1, False, PROMPTS)


@pytest.fixture(scope="module")
def uncached_tight(qwen2_tiny_path):
    return _run(qwen2_tiny_path, "separate", 1, False, TIGHT_PROMPTS, **TIGHT)


@pytest.mark.parametrize("policy", ["separate", "hybrid", "throttle", "td-pipe"])
def test_cached_prefix_gives_the_same_tokens(qwen2_tiny_path, uncached, policy):
    off, s_off = uncached
    on, s_on = _run(qwen2_tiny_path, policy, 1, True, PROMPTS)
    assert on == off
    assert s_off["hits"] == 0 and s_off["queries"] == 0
    # every later request finds the system prompt's full blocks (~190 tokens of ~200)
    assert s_on["hit_rate"] > 0.6, s_on
    # and says so in its output (vLLM's RequestOutput.num_cached_tokens), whole blocks of 16
    shared = len(SYSTEM) // 16 * 16 // 8  # far fewer tokens than characters: a safe lower bound
    assert s_off["cached_tokens"] == [0] * len(PROMPTS) and s_on["cached_tokens"][0] == 0
    assert all(c % 16 == 0 and c >= shared for c in s_on["cached_tokens"][1:]), s_on["cached_tokens"]


@pytest.mark.parametrize("policy", ["separate", "throttle"])
def test_cached_prefix_pp2(qwen2_tiny_path, uncached, policy):
    on, s_on = _run(qwen2_tiny_path, policy, 2, True, PROMPTS[:4])
    assert on == uncached[0][:4] and s_on["hits"] > 0 and min(s_on["cached_tokens"][1:]) > 0


@pytest.mark.parametrize("policy", ["separate", "throttle"])
def test_caching_under_preemption_and_eviction(qwen2_tiny_path, uncached_tight, policy):
    """A 10-block cache: requests evict each other's cached blocks and are preempted; a recomputed request
    hits its own earlier blocks. Outputs equal the uncached run."""
    off, s_off = uncached_tight
    on, s_on = _run(qwen2_tiny_path, policy, 1, True, TIGHT_PROMPTS, **TIGHT)
    assert on == off
    assert s_off["preemptions"] > 0 and s_on["preemptions"] > 0 and s_on["hits"] > 0


def test_greedy_parity_with_transformers_with_caching_on(llm_fp32, hf_fp32):
    """The session LLM runs with caching on (the default); the same prompt twice: the second is a hit and
    both equal transformers."""
    from conftest import hf_greedy

    assert llm_fp32.engine.block_manager.enable_prefix_caching
    tok = llm_fp32.get_tokenizer()
    p = SYSTEM + QUESTIONS[0]
    before = llm_fp32.engine.block_manager.prefix_cache_hits
    a = llm_fp32.generate([p], _greedy(), use_tqdm=False)[0].outputs[0].token_ids
    b = llm_fp32.generate([p], _greedy(), use_tqdm=False)[0].outputs[0].token_ids
    assert llm_fp32.engine.block_manager.prefix_cache_hits - before >= len(tok.encode(p)) // 16 * 16 - 16
    assert a == b == hf_greedy(hf_fp32, tok.encode(p), 16)
