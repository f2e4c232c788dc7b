"""W8A8 (--quantization w8a8) through the engine: the prompt log-probabilities it computes stay close to the
unquantized model's, pp = 2 and tp = 2 compute what pp = 1 computes, and n > 1, logprobs and prefix caching
keep working. Log-probabilities of the prompt's own tokens compare the whole forward pass position by
position, where greedy tokens would only compare argmaxes."""
import pytest

from tdpipe import LLM, SamplingParams

from conftest import prompt_lps

TEXT = ("The capital of France is Paris. It is known for the Eiffel Tower, the Louvre and its cafes. "
        "Water boils at 100 degrees Celsius at sea level, and freezes at zero.")
KV = 256 << 20


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 10
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def ids_and_float(bundled_path):
    with LLM(bundled_path, dtype="float32", kv_cache_memory=KV) as llm:
        ids = llm.get_tokenizer().encode(TEXT)
        return ids, prompt_lps(llm, ids)


def test_w8a8_tracks_the_float_model_and_pp2_computes_what_pp1_does(bundled_path, ids_and_float):
    ids, ref = ids_and_float
    with LLM(bundled_path, dtype="float32", quantization="w8a8", kv_cache_memory=KV) as llm:
        one = prompt_lps(llm, ids)
        # the rest of the engine on the quantized model: n > 1 with logprobs, then a cached prefix
        sp = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=6, logprobs=2, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].outputs
        assert len(outs) == 2 and all(len(c.token_ids) == 6 and len(c.logprobs) == 6 for c in outs)
        assert llm.engine.block_manager.enable_prefix_caching and prompt_lps(llm, ids) == one
    with LLM(bundled_path, dtype="float32", quantization="w8a8", pipeline_parallel_size=2, kv_cache_memory=KV) as llm:
        two = prompt_lps(llm, ids)
    # per token the int8 rounding moves a logprob by ~0.2 nats either way; on average (the log of the
    # perplexity ratio) it costs a few hundredths (docs/quantization.md: +2% perplexity on a long text)
    spread = sum(abs(x - y) for x, y in zip(one, ref)) / len(ref)
    cost = sum(y - x for x, y in zip(one, ref)) / len(ref)
    assert spread < 0.35 and abs(cost) < 0.08, (spread, cost)
    assert one != ref  # the quantized path really ran
    # per-token activation scales and exact int32 GEMMs: a row's numbers do not depend on the micro-batch,
    # (the lm_head's activations are scaled per block of 32 of each row); a small tolerance all the same
    assert _max_diff(one, two) < 0.05


def test_w8a8_under_tensor_parallelism(qwen2_tiny):
    """tp = 2 splits the row-parallel linears' inputs, each rank quantising its half per token: close to
    tp = 1, not bit-equal. In this tiny model (hidden 64) those halves are 32 wide, too narrow for the
    rotation's 64-wide blocks, so tp = 2 runs o_proj and down_proj unrotated where tp = 1 rotates them."""
    folder, _ = qwen2_tiny
    ids = list(range(5, 45))
    with LLM(folder, dtype="float32", quantization="w8a8", kv_cache_memory=KV) as llm:
        one = prompt_lps(llm, ids)
    with LLM(folder, dtype="float32", quantization="w8a8", tensor_parallel_size=2, kv_cache_memory=KV) as llm:
        two = prompt_lps(llm, ids)
    assert _max_diff(one, two) < 0.1
