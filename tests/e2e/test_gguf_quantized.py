"""The bundled Q4_1 GGUF run with its weights kept packed (--quantization gguf: W4A8 in the decoder, its
Q8_0 embedding as the tied lm_head) against the same file dequantised (--quantization none): prompt
log-probabilities close, greedy tokens mostly the same; pp = 2 computes what pp = 1 computes; n > 1,
logprobs and prefix caching keep working; `auto` keeps a .gguf --model quantised."""
import pytest
import torch

from tdpipe import LLM, SamplingParams
from tdpipe.model.block_linear import BlockEmbedding, BlockLinear

from conftest import prompt_lps

TEXT = ("The capital of France is Paris. It is known for the Eiffel Tower, the Louvre and its cafes. "
        "Water boils at 100 degrees Celsius at sea level, and freezes at zero.")
KV = 256 << 20
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _greedy(llm: LLM, ids: list[int]) -> list[int]:
    return list(llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


@pytest.fixture(scope="module")
def dequantised(bundled_path):
    """The prompt, its log-probabilities and the greedy answer to its first 12 tokens with the top 5 of each
    step, from the file dequantised."""
    with LLM(quantization="none", kv_cache_memory=KV) as llm:
        ids = llm.get_tokenizer().encode(TEXT)
        sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
        out = llm.generate([{"prompt_token_ids": ids[:12]}], sp, use_tqdm=False)[0].outputs[0]
        tops = [{t: lp.logprob for t, lp in step.items()} for step in out.logprobs]
        return ids, prompt_lps(llm, ids), (list(out.token_ids), tops)


def test_gguf_blocks_track_the_dequantised_file_at_pp1_and_pp2(dequantised):
    ids, ref, ref_greedy = dequantised
    with LLM(quantization="gguf", kv_cache_memory=KV) as llm:
        one, greedy_one = prompt_lps(llm, ids), _greedy(llm, ids[:12])
        sp = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=6, logprobs=2, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].outputs
        assert len(outs) == 2 and all(len(c.token_ids) == 6 and len(c.logprobs) == 6 for c in outs)
        assert llm.engine.block_manager.enable_prefix_caching and prompt_lps(llm, ids) == one
    with LLM(quantization="gguf", pipeline_parallel_size=2, kv_cache_memory=KV) as llm:
        two, greedy_two = prompt_lps(llm, ids), _greedy(llm, ids[:12])
    # the weights are the file's exactly; only the int8 activations (one scale per 32 values) differ
    spread = sum(abs(x - y) for x, y in zip(one, ref)) / len(ref)
    cost = sum(y - x for x, y in zip(one, ref)) / len(ref)
    assert spread < 0.15 and abs(cost) < 0.05, (spread, cost)
    assert one != ref  # the quantised path really ran
    # greedy agreement is reported, not required; where the answers part, the dequantised file must have been
    # near a tie (measured: 0.21 nats apart at the first token on an AVX2 CPU in float32, where they part)
    ref_tokens, ref_tops = ref_greedy
    part = next((i for i, (a, b) in enumerate(zip(greedy_one, ref_tokens)) if a != b), None)
    if part is not None:
        top, pick = ref_tops[part], greedy_one[part]
        assert pick in top and max(top.values()) - top[pick] < 0.5, (part, greedy_one, ref_tokens, top)
    # each row's sums do not depend on the micro-batch it rides in: pp = 2 is pp = 1
    assert max(abs(x - y) for x, y in zip(one, two)) < 0.02 and greedy_one == greedy_two


def test_auto_keeps_a_gguf_file_quantised_and_the_bundled_default_dequantised(tmp_path):
    from tdpipe.model.bundled import bundled_gguf_path
    from tdpipe.model.quantization import resolve_quantization

    path = bundled_gguf_path()
    assert resolve_quantization("auto", path, "cpu", True) == ("gguf", path)
    assert resolve_quantization("auto", path, "cpu", False) == ("none", "")  # float32: the exact values
    assert resolve_quantization("auto", path, "cuda", True) == ("none", "")
    assert resolve_quantization("auto", None, "cpu", True) == ("none", "")  # the bundled model: bf16 as before
    assert resolve_quantization("gguf", None, "cpu", True) == ("gguf", path)
    with pytest.raises(ValueError, match="needs a GGUF --model"):
        resolve_quantization("gguf", str(tmp_path), "cpu", True)


def test_the_slice_holds_packed_blocks(bundled_path):
    """What the stages build: 4-bit decoder linears, the Q8_0 embedding shared with the tied head."""
    from tdpipe.config import ModelConfig
    from tdpipe.model.bundled import bundled_gguf_path
    from tdpipe.model.llama import LlamaForCausalLM
    from tdpipe.model.quantization import prepare_linears
    from tdpipe.model.weights import iter_safetensors, load_hf_config

    cfg = ModelConfig.from_hf(load_hf_config(bundled_path))
    model = LlamaForCausalLM(cfg, 0, 2)  # a two-layer slice with the embedding, no head
    model.load_weights(iter_safetensors(bundled_path, names=model.wants))
    model = model.to(torch.bfloat16)
    ids = torch.tensor([0, 1, 17, 4095, cfg.vocab_size - 1])
    rows, qkv = model.embed_tokens.weight[ids].clone(), model.layers[0].self_attn.qkv_proj.weight.clone()
    assert prepare_linears(model, "gguf", bundled_gguf_path()) == 2 * 4 + 1
    lin = model.layers[0].self_attn.qkv_proj
    assert isinstance(lin, BlockLinear) and lin.bits == 4 and lin.packed.dtype == torch.uint8
    assert isinstance(model.embed_tokens, BlockEmbedding) and model.embed_tokens.head.bits == 8
    # the file's values, in the conversion's row order (q/k un-permuted), rounded as the conversion rounds
    assert torch.equal(lin.dequantized().to(torch.bfloat16), qkv)
    assert torch.equal(model.embed_tokens(ids), rows)
    assert lin.out_features == cfg.num_heads * cfg.head_dim + 2 * cfg.num_kv_heads * cfg.head_dim


def test_new_weights_replace_the_files_blocks(bundled_path):
    """update_weights on a packed GGUF run: the new weights run, quantised from their floats (the file's
    blocks are the old weights); the folder the run started from brings the file's blocks back."""
    from tdpipe.model.weights import iter_safetensors

    with LLM(quantization="gguf", kv_cache_memory=KV) as llm:
        ids = llm.get_tokenizer().encode(TEXT)[:16]
        lps = prompt_lps(llm, ids)
        silenced = [(n, t * 0 if "mlp.down_proj" in n else t) for n, t in iter_safetensors(bundled_path)]
        llm.update_weights(silenced)
        changed = prompt_lps(llm, ids)
        assert max(abs(a - b) for a, b in zip(changed, lps)) > 1.0  # the MLPs are off: not the file's blocks
        llm.update_weights(bundled_path)
        assert prompt_lps(llm, ids) == lps
