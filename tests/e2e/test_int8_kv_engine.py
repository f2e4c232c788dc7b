"""--kv-cache-dtype int8 through the engine on the bundled model: the prompt log-probabilities stay close to the
bf16 cache's (every position attends over the quantised keys and values, the prompt's own ones included), the
budget holds nearly twice the blocks, pp = 2 computes what pp = 1 computes, and n > 1, logprobs and prefix
caching keep working; with W8A8 linears too."""
from tdpipe import LLM, SamplingParams

from conftest import prompt_lps

TEXT = ("The capital of France is Paris. It is known for the Eiffel Tower, the Louvre and its cafes. "
        "Water boils at 100 degrees Celsius at sea level, and freezes at zero. The tallest mountain on Earth is "
        "Mount Everest, and the longest river is the Nile.")
KV = 64 << 20


def test_int8_cache_tracks_the_bf16_cache_and_holds_more(bundled_path):
    # bf16 named: the default dtype is float32 on a CPU without avx512_bf16, whose rows are 256 bytes
    with LLM(bundled_path, kv_cache_memory=KV, dtype="bfloat16") as llm:
        ids = llm.get_tokenizer().encode(TEXT)
        ref = prompt_lps(llm, ids)
        blocks = llm.engine.block_manager.num_blocks
    with LLM(bundled_path, kv_cache_memory=KV, kv_cache_dtype="int8", dtype="bfloat16") as llm:
        one = prompt_lps(llm, ids)
        # 64 bf16 values (128 bytes) against 64 int8 values and a float32 scale (68 bytes) per row
        assert 1.85 < llm.engine.block_manager.num_blocks / blocks < 1.9
        sp = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=6, logprobs=2, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].outputs
        assert len(outs) == 2 and all(len(c.token_ids) == 6 and len(c.logprobs) == 6 for c in outs)
        greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        first = llm.generate([{"prompt_token_ids": ids}], greedy, use_tqdm=False)[0].outputs[0].token_ids
        hits = llm.engine.block_manager.prefix_cache_stats()["hits"]
        again = llm.generate([{"prompt_token_ids": ids}], greedy, use_tqdm=False)[0].outputs[0].token_ids
        assert llm.engine.block_manager.prefix_cache_stats()["hits"] > hits and again == first  # cached int8 blocks
    spread = sum(abs(x - y) for x, y in zip(one, ref)) / len(ref)
    cost = sum(y - x for x, y in zip(one, ref)) / len(ref)
    assert one != ref and spread < 0.1 and abs(cost) < 0.03, (spread, cost)


def test_int8_cache_at_pp2_with_w8a8(bundled_path):
    ids = list(range(100, 160))
    with LLM(bundled_path, kv_cache_memory=KV, kv_cache_dtype="int8", quantization="w8a8", dtype="float32") as llm:
        one = prompt_lps(llm, ids)
    with LLM(bundled_path, kv_cache_memory=KV, kv_cache_dtype="int8", quantization="w8a8", dtype="float32",
             pipeline_parallel_size=2) as llm:
        two = prompt_lps(llm, ids)
    assert max(abs(x - y) for x, y in zip(one, two)) < 0.02
