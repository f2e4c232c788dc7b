"""Greedy tokens of the families beside Llama and Qwen2 through tdpipe's engine, transformers the oracle:
random tiny checkpoints saved by transformers itself (its names, its config.json), float32, at pp = 1 for
each family and pp = 2 for each, tp = 2 for Phi-3 (fused q/k/v and gate/up tensors cut per rank).
Llama with attention_bias and mlp_bias at pp = 1, 2, tp = 2 (row-parallel biases added once) and W8A8.
Gemma 2 with its soft-capped attention scores and logits, at pp = 1, 2 and tp = 2; Granite's multipliers.
Prompts run past the sliding windows (Mistral 20 tokens, Gemma 2/3's local layers 8), the case a window that is
read but not applied gets wrong; Gemma 3 has the 262,144-token vocabulary of the published models."""
import pytest
import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, GemmaConfig,
                          GemmaForCausalLM, GraniteConfig, GraniteForCausalLM, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

from conftest import hf_greedy, prompt_lps
from tdpipe import LLM, SamplingParams
from tdpipe.model.random_model import write_tokenizer

N_OUT = 16
SIZES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, eos_token_id=1, bos_token_id=2, pad_token_id=0)
MISTRAL_WINDOW = 20


def _configs() -> dict:
    return {
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(**SIZES, vocab_size=300, head_dim=32, tie_word_embeddings=False)),
        "mistral": (MistralForCausalLM, MistralConfig(**SIZES, vocab_size=300, sliding_window=MISTRAL_WINDOW)),
        "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig(
            **SIZES, vocab_size=262144, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_theta=1e6, rope_local_base_freq=1e4)),
        "phi3": (Phi3ForCausalLM, Phi3Config(
            **SIZES, vocab_size=300, partial_rotary_factor=0.5, original_max_position_embeddings=128,
            rope_scaling={"type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0],
                          "long_factor": [2.0, 3.0, 4.0, 5.0]})),
        "gemma": (GemmaForCausalLM, GemmaConfig(**SIZES, vocab_size=300, head_dim=32)),
        # every other layer sliding; caps low enough that these weights' scores and logits bend under them
        "gemma2": (Gemma2ForCausalLM, Gemma2Config(**SIZES, vocab_size=300, head_dim=32, query_pre_attn_scalar=24,
                                                   sliding_window=8, attn_logit_softcapping=2.0,
                                                   final_logit_softcapping=3.0)),
        # Granite's multipliers on the embeddings, the attention scale, each residual branch and the logits
        "granite": (GraniteForCausalLM, GraniteConfig(**SIZES, vocab_size=300, embedding_multiplier=3.0,
                                                      attention_multiplier=0.2, residual_multiplier=0.3,
                                                      logits_scaling=4.0)),
        # one KV head (as Gemma 3 270M): at tp = 2 each rank holds a copy of it and half its query heads
        "llama_kv1": (LlamaForCausalLM, LlamaConfig(**{**SIZES, "num_key_value_heads": 1}, vocab_size=300)),
        # Llama with its optional biases: q/k/v/o (attention_bias) and gate/up/down (mlp_bias)
        "llama_bias": (LlamaForCausalLM, LlamaConfig(**SIZES, vocab_size=300, attention_bias=True, mlp_bias=True)),
    }


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """name -> (folder, prompts, transformers' greedy tokens) of that family, each built once per module."""
    made: dict = {}

    def get(name: str) -> tuple[str, list[list[int]], list[list[int]]]:
        if name not in made:
            cls, cfg = _configs()[name]
            torch.manual_seed(0)
            model = cls(cfg).eval()
            with torch.no_grad():  # every weight away from its init (Gemma's norms start at 0): no near-ties
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.1)
            d = tmp_path_factory.mktemp(name)
            model.save_pretrained(d)
            write_tokenizer(d, {"vocab_size": cfg.vocab_size, "eos_token_id": 1, "max_position_embeddings": 256})
            g = torch.Generator().manual_seed(1)
            prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in (41, 26, 5)]
            made[name] = str(d), prompts, [hf_greedy(model, p, N_OUT) for p in prompts]
        return made[name]

    return get


def _run(folder: str, prompts: list[list[int]], **kw) -> list[list[int]]:
    with LLM(model=folder, dtype="float32", kv_cache_memory=32 << 20, **kw) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True), use_tqdm=False)
        llm.engine.block_manager.check_no_leaks()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", ["qwen3", "mistral", "gemma", "gemma2", "gemma3", "phi3", "granite"])
def test_greedy_parity_pp1(families, name):
    folder, prompts, ref = families(name)
    assert max(len(p) for p in prompts) + N_OUT > 2 * MISTRAL_WINDOW  # well past every window
    assert _run(folder, prompts) == ref


@pytest.mark.parametrize("name", ["qwen3", "mistral", "gemma", "gemma2", "gemma3", "phi3", "granite"])
def test_greedy_parity_pp2(families, name):
    folder, prompts, ref = families(name)
    assert _run(folder, prompts, pipeline_parallel_size=2, layer_partition=[2, 2], lm_head_split=0.0) == ref


def test_greedy_parity_tp2_gemma2_capped_and_sliding(families):
    """Gemma 2 at tp = 2: each rank caps its own heads' scores, the windows and the logit cap unchanged."""
    folder, prompts, ref = families("gemma2")
    assert _run(folder, prompts, tensor_parallel_size=2) == ref


@pytest.mark.parametrize("family", ["gemma", "gemma2", "granite"])
def test_greedy_parity_through_a_gguf_file(families, tmp_path, family):
    """Gemma (1), Gemma 2 and Granite written as llama.cpp's converter writes them (Gemma's norms as 1 + w,
    Gemma 2's caps and window, Granite's q/k rows permuted and its multipliers as *_scale keys), read back by
    tdpipe's GGUF loader (transformers' config reader refuses Gemma 1 and Granite: it is shown Gemma 2 and
    Llama, its vocabulary builder reads the files as they are): transformers' greedy tokens, pp = 1 and 2."""
    from tdpipe.model.gguf_export import write_gguf

    folder, prompts, ref = families(family)
    path = str(write_gguf(folder, tmp_path / f"{family}.gguf", dtype="f32"))
    assert _run(path, prompts) == ref
    assert _run(path, prompts, pipeline_parallel_size=2) == ref


def test_greedy_parity_tp2_phi3_fused_tensors(families):
    folder, prompts, ref = families("phi3")
    assert _run(folder, prompts, tensor_parallel_size=2) == ref


@pytest.mark.parametrize("kw", [{}, {"pipeline_parallel_size": 2}, {"tensor_parallel_size": 2}],
                         ids=["pp1", "pp2", "tp2"])
def test_greedy_parity_llama_biases(families, kw):
    """o_proj's and down_proj's biases are row-parallel: under tp = 2 each rank holds them whole and only
    rank 0 adds them, or the all-reduce would add them twice."""
    folder, prompts, ref = families("llama_bias")
    assert _run(folder, prompts, **kw) == ref


def test_w8a8_keeps_the_biases(families):
    """W8A8's linears add the biases in their float epilogue (and a biased gate_up leaves the fused SwiGLU
    path): the quantized prompt log-probabilities stay near the float ones (0.015 nats apart on average when
    written), where dropping one kind of bias moves this model's by 0.05 (q_proj's) to 0.44 (o_proj's)."""
    folder, prompts, _ = families("llama_bias")
    ids = prompts[0] + prompts[1]
    lps = {}
    for q in ("none", "w8a8"):
        with LLM(model=folder, dtype="float32", kv_cache_memory=32 << 20, quantization=q) as llm:
            lps[q] = prompt_lps(llm, ids)
    assert lps["none"] != lps["w8a8"]
    assert sum(abs(a - b) for a, b in zip(lps["none"], lps["w8a8"])) / len(ids) < 0.035


def test_greedy_parity_tp2_with_one_kv_head_replicated(families):
    """More ranks than KV heads: the KV head replicated on both ranks, its query heads split (vLLM's rule),
    at tp = 2 and at pp = 2 x tp = 2."""
    folder, prompts, ref = families("llama_kv1")
    assert _run(folder, prompts, tensor_parallel_size=2) == ref
    assert _run(folder, prompts, tensor_parallel_size=2, pipeline_parallel_size=2) == ref
