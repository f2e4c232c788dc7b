"""GGUF conversion per architecture (llama, Mistral-as-llama, qwen2, qwen3, phi3, gemma, gemma2, gemma3,
granite).

Each test writes a tiny GGUF the way llama.cpp's converter does (its tensor names, its q/k row permutation
for Llama, its 1 + w Gemma norms, Phi-3's fused tensors and LongRoPE factor tensors) from a random
transformers model, converts it, and checks three oracles: transformers' own GGUF loader
(load_gguf_checkpoint; it reads neither Gemma 1 nor Granite) gives the same tensors, the tensors are the
original model's, and the original model's logits come back from the converted config + tensors. Small enough
to run in seconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
import transformers
from gguf import GGUFWriter

from tdpipe.model.gguf import convert_gguf_to_hf_folder, gguf_to_hf

# llama.cpp's tensor names (convert_hf_to_gguf.py / gguf-py tensor_mapping), written here independently of
# the converter's table
_LLAMA_CPP_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_GEMMA_NAMES = _LLAMA_CPP_NAMES | {"post_attention_layernorm": "post_attention_norm",
                                   "pre_feedforward_layernorm": "ffn_norm",
                                   "post_feedforward_layernorm": "post_ffw_norm"}

# a SentencePiece-style vocabulary ("llama" tokenizer model) and a byte-level BPE one ("gpt2")
_SP_PIECES = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "hell", "hello", "\u2581hello", "or",
              "ld",
              "wor", "world", "\u2581world", "\u2581w"]
_BPE_TOKENS = ["h", "e", "l", "o", "w", "r", "d", "\u0120", "he", "ll", "hell", "hello", "\u0120w", "or",
               "ld",
               "\u0120wor", "\u0120world"]
_BPE_MERGES = ["h e", "l l", "he ll", "hell o", "\u0120 w", "o r", "l d", "\u0120w or", "\u0120wor ld"]
_CHAT = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}" \
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
_PHI3_CHAT = "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}<|assistant|>\n"


def _llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: HF's half-split rope rows -> interleaved pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _llama_cpp_rope_freqs(base: float, dim: int, factor: float = 8.0, low: float = 1.0, high: float = 4.0,
                          old_context_len: int = 8192) -> np.ndarray:
    """llama.cpp's LlamaModel.generate_extra_tensors for a llama3 rope_scaling, in torch as it does it."""
    import math

    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_context_len / high:
            out.append(1)
        elif wavelen > old_context_len / low:
            out.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def _vocab(kind: str) -> tuple[list[str], list[int], dict[str, int]]:
    """(tokens, token types, special ids) of a tiny vocabulary; 3 = CONTROL, 2 = UNKNOWN, 1 = NORMAL."""
    if kind == "gpt2":
        special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        return special + _BPE_TOKENS, [3] * 3 + [1] * len(_BPE_TOKENS), {"bos": 0, "eos": 2}
    if kind == "gemma":
        special = ["<pad>", "<eos>", "<bos>", "<unk>"]
        ids = {"bos": 2, "eos": 1, "unk": 3, "pad": 0}
        return special + _SP_PIECES, [3, 3, 3, 2] + [1] * len(_SP_PIECES), ids
    special = ["<unk>", "<s>", "</s>", "<|end|>"]
    return special + _SP_PIECES, [2, 3, 3, 3] + [1] * len(_SP_PIECES), {"bos": 1, "eos": 2, "unk": 0}


def _add_tokenizer(w: GGUFWriter, kind: str, chat_template: str | None) -> None:
    tokens, types, ids = _vocab(kind)
    w.add_tokenizer_model("gpt2" if kind == "gpt2" else "llama")
    w.add_tokenizer_pre("qwen2" if kind == "gpt2" else "default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    if kind == "gpt2":
        w.add_token_merges(_BPE_MERGES)
    else:  # SentencePiece scores: longer pieces merge first
        w.add_token_scores([float(len(t)) if ty == 1 else 0.0 for t, ty in zip(tokens, types)])
    w.add_bos_token_id(ids["bos"])
    w.add_eos_token_id(ids["eos"])
    if "unk" in ids:
        w.add_unk_token_id(ids["unk"])
    if "pad" in ids:
        w.add_pad_token_id(ids["pad"])
    w.add_add_bos_token(kind != "gpt2")
    if chat_template is not None:
        w.add_chat_template(chat_template)


def _randomise(model: torch.nn.Module) -> None:
    """Every parameter random (norms too: an initialised norm is all ones or zeros and hides offsets)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


class _Case:
    def __init__(self, arch: str, cfg: Any, tok: str, meta: Callable[[GGUFWriter], None] = lambda w: None,
                 names: dict[str, str] = _LLAMA_CPP_NAMES, permute: bool = False, norm_plus_one: bool = False,
                 chat_template: str | None = None, expect_arch: str | None = None) -> None:
        self.arch, self.cfg, self.tok, self.meta, self.names = arch, cfg, tok, meta, names
        self.permute, self.norm_plus_one, self.chat_template = permute, norm_plus_one, chat_template
        self.expect_arch = expect_arch or cfg.architectures[0]


def _common(**kw: Any) -> dict[str, Any]:
    return dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, **kw)


def _cases() -> dict[str, _Case]:
    T = transformers
    n_sp, n_bpe = len(_vocab("llama")[0]), len(_vocab("gpt2")[0])

    def window(n: int) -> Callable[[GGUFWriter], None]:
        return lambda w: (w.add_sliding_window(n), w.add_name("Mistral Tiny"))

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}

    def longrope(w: GGUFWriter) -> None:
        w.add_rope_scaling_orig_ctx_len(32)
        w.add_tensor("rope_factors_long.weight", np.array([1.0 + i / 8 for i in range(4)], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array([1.0 + i / 16 for i in range(4)], np.float32))

    return {
        "llama": _Case("llama", T.LlamaConfig(vocab_size=n_sp, tie_word_embeddings=True,
                                              architectures=["LlamaForCausalLM"], **_common()),
                       "llama", permute=True),
        # Llama 3.1+: llama.cpp folds rope_scaling into a rope_freqs tensor (rope_theta 5e5: every branch of
        # llama3's factor curve is hit at head_dim 16)
        "llama3": _Case("llama", T.LlamaConfig(vocab_size=n_sp, tie_word_embeddings=True, rope_theta=500000.0,
                                               rope_scaling=llama3, architectures=["LlamaForCausalLM"],
                                               **_common()),
                        "llama",
                        lambda w: w.add_tensor("rope_freqs.weight", _llama_cpp_rope_freqs(500000.0, 16)),
                        permute=True),
        "mistral": _Case("llama", T.MistralConfig(vocab_size=n_sp, sliding_window=8,
                                                  tie_word_embeddings=False,
                                                  architectures=["MistralForCausalLM"], **_common()),
                         "llama", window(8), permute=True),
        "qwen2": _Case("qwen2", T.Qwen2Config(vocab_size=n_bpe, tie_word_embeddings=False,
                                              architectures=["Qwen2ForCausalLM"], **_common()), "gpt2"),
        # head_dim 32 != hidden / heads: llama.cpp writes it as attention.key_length
        "qwen3": _Case("qwen3", T.Qwen3Config(vocab_size=n_bpe, head_dim=32, tie_word_embeddings=True,
                                              architectures=["Qwen3ForCausalLM"], **_common()), "gpt2",
                       chat_template=_CHAT),
        # Phi-4-mini style partial rotary (half of each head), LongRoPE factors for that half
        "phi3": _Case("phi3", T.Phi3Config(vocab_size=n_sp, tie_word_embeddings=False,
                                           original_max_position_embeddings=32,
                                           partial_rotary_factor=0.5,
                                           rope_scaling={"rope_type": "longrope",
                                                         "long_factor": [1.0 + i / 8 for i in range(4)],
                                                         "short_factor": [1.0 + i / 16 for i in range(4)]},
                                           sliding_window=None, pad_token_id=0, bos_token_id=1,
                                           eos_token_id=2,
                                           architectures=["Phi3ForCausalLM"], **_common()),
                      "llama", longrope, chat_template=_PHI3_CHAT),
        # Gemma (1): Llama's layout, Gemma's 1 + w norms, tied embeddings (transformers' GGUF loader does not
        # read this architecture: the original model is the oracle)
        "gemma": _Case("gemma", T.GemmaConfig(vocab_size=n_sp, head_dim=32, architectures=["GemmaForCausalLM"],
                                              **_common()), "gemma", norm_plus_one=True),
        # Granite: Llama's layout (q/k permuted) and the four multipliers as llama.cpp's *_scale keys
        "granite": _Case("granite", T.GraniteConfig(vocab_size=n_bpe, embedding_multiplier=3.0,
                                                    attention_multiplier=0.2, residual_multiplier=0.3,
                                                    logits_scaling=4.0, tie_word_embeddings=True,
                                                    architectures=["GraniteForCausalLM"], **_common()),
                         "gpt2", lambda w: (w.add_attention_scale(0.2), w.add_embedding_scale(3.0),
                                            w.add_residual_scale(0.3), w.add_logit_scale(4.0)), permute=True),
        # what llama.cpp's converter writes for Gemma 2: the window and both caps; the layers alternate
        "gemma2": _Case("gemma2", T.Gemma2Config(vocab_size=n_sp, head_dim=32, query_pre_attn_scalar=32,
                                                 sliding_window=8, attn_logit_softcapping=50.0,
                                                 final_logit_softcapping=30.0, architectures=["Gemma2ForCausalLM"],
                                                 **_common()),
                        "gemma",
                        lambda w: (w.add_sliding_window(8), w.add_attn_logit_softcapping(50.0),
                                   w.add_final_logit_softcapping(30.0)),
                        names=_GEMMA_NAMES, norm_plus_one=True),
        "gemma3": _Case("gemma3", T.Gemma3TextConfig(vocab_size=n_sp, head_dim=32, query_pre_attn_scalar=32,
                                                     layer_types=["sliding_attention", "full_attention"],
                                                     sliding_window=8, architectures=["Gemma3ForCausalLM"],
                                                     **_common()),
                        "gemma",
                        lambda w: (w.add_sliding_window(8), w.add_sliding_window_pattern([True, False])),
                        names=_GEMMA_NAMES, norm_plus_one=True),
    }


CASES = _cases()


def _write_like_llama_cpp(path: Path, case: _Case) -> torch.nn.Module:
    """A random model of ``case``, written as llama.cpp's converter would; returns the model."""
    torch.manual_seed(0)
    cfg = case.cfg
    model = getattr(transformers, cfg.architectures[0])(cfg).eval()
    _randomise(model)
    w = GGUFWriter(str(path), case.arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rotary = cfg.rope_parameters.get("partial_rotary_factor") or 1.0  # Phi-3 only; a flat dict there
    w.add_rope_dimension_count(int(head_dim * rotary))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    theta = cfg.rope_parameters.get("full_attention", cfg.rope_parameters).get("rope_theta")
    w.add_rope_freq_base(theta)
    case.meta(w)
    _add_tokenizer(w, case.tok, case.chat_template)
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        t = t.float()
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            sub, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{case.names[sub]}.{kind}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight",
                     "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        if case.permute and ".attn_q." in gname:
            t = _llama_cpp_permute(t, heads)
        elif case.permute and ".attn_k." in gname:
            t = _llama_cpp_permute(t, kv)
        if case.norm_plus_one and gname.endswith("norm.weight"):
            t = t + 1
        w.add_tensor(gname, t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    d = tmp_path_factory.mktemp("gguf_families")
    return {k: (d / f"{k}.gguf", _write_like_llama_cpp(d / f"{k}.gguf", c)) for k, c in CASES.items()}


def _hf_from(cfg: dict, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    conf = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "torch_dtype"})
    model = getattr(transformers, cfg["architectures"][0])(conf).eval()
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if cfg["tie_word_embeddings"] else set())
    model.tie_weights()
    return model


@pytest.mark.parametrize("family", sorted(CASES))
def test_family_converts_like_transformers(family: str, written: dict) -> None:
    import transformers.modeling_gguf_pytorch_utils as ggp

    path, original = written[family]
    case = CASES[family]
    cfg, it = gguf_to_hf(path)
    ours = dict(it)
    assert cfg["architectures"] == [case.expect_arch]
    # 1. transformers' GGUF loader on the same file: the same tensors, bit for bit (where it reads the file)
    if case.arch not in ggp.GGUF_SUPPORTED_ARCHITECTURES:
        assert case.arch in ("gemma", "granite")
        _compare_with_original(ours, original, case, cfg)
        return
    as_llama = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]} if family == "mistral" else {}
    plain = {k: v for k, v in cfg.items() if k != "torch_dtype"}
    conf = transformers.AutoConfig.for_model(**(plain | as_llama))
    skeleton_arch = conf.architectures[0]  # transformers reads Mistral files as llama: the same tensors
    with torch.device("meta"):
        skeleton = getattr(transformers, skeleton_arch)(conf)
    ref = ggp.load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    assert set(ours) == set(ref)
    for name, w in ours.items():
        assert w.dtype == torch.float32
        torch.testing.assert_close(w, ref[name].float(), rtol=0, atol=0, msg=name)
    _compare_with_original(ours, original, case, cfg)


def _compare_with_original(ours: dict, original: torch.nn.Module, case: _Case, cfg: dict) -> None:
    # 2. the original model's tensors (Gemma's w + 1 - 1 rounds in float32)
    sd = original.state_dict()
    for name, w in ours.items():
        torch.testing.assert_close(w, sd[name], rtol=0, atol=1e-6 if case.norm_plus_one else 0, msg=name)
    # 3. the original logits, past the sliding window where there is one
    ids = torch.randint(0, cfg["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(_hf_from(cfg, ours)(ids).logits, original(ids).logits,
                                   rtol=1e-4, atol=1e-4)


def test_configs_carry_family_keys(written: dict) -> None:
    cfg = {k: gguf_to_hf(p)[0] for k, (p, _) in written.items()}
    assert cfg["llama"]["architectures"] == ["LlamaForCausalLM"] and "sliding_window" not in cfg["llama"]
    assert "rope_scaling" not in cfg["llama"]
    assert cfg["llama3"]["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 8192}
    assert cfg["mistral"]["sliding_window"] == 8
    assert cfg["qwen3"]["head_dim"] == 32 and cfg["qwen3"]["attention_bias"] is False
    assert cfg["qwen3"]["tie_word_embeddings"] is True and cfg["qwen2"]["tie_word_embeddings"] is False
    phi = cfg["phi3"]
    assert phi["original_max_position_embeddings"] == 32 and phi["sliding_window"] is None
    assert phi["rope_scaling"]["rope_type"] == "longrope"
    assert phi["rope_scaling"]["long_factor"] == [1.0 + i / 8 for i in range(4)]
    assert phi["partial_rotary_factor"] == 0.5 and "partial_rotary_factor" not in cfg["llama"]
    g2 = cfg["gemma2"]
    assert (g2["model_type"], g2["head_dim"], g2["sliding_window"], g2["query_pre_attn_scalar"]) == \
        ("gemma2", 32, 8, 32)
    assert (g2["attn_logit_softcapping"], g2["final_logit_softcapping"]) == (50.0, 30.0)
    assert g2["layer_types"] == ["sliding_attention", "full_attention"] and "rope_local_base_freq" not in g2
    g = cfg["gemma3"]
    assert (g["model_type"], g["head_dim"], g["sliding_window"]) == ("gemma3_text", 32, 8)
    assert g["layer_types"] == ["sliding_attention", "full_attention"]
    assert (g["rope_theta"], g["rope_local_base_freq"], g["query_pre_attn_scalar"]) == (1e6, 1e4, 32)
    assert g["hidden_activation"] == "gelu_pytorch_tanh" and g["final_logit_softcapping"] is None


def test_mistral_without_window_is_mistral_with_none(tmp_path: Path) -> None:
    """A Mistral file without a window key (v0.2+): MistralForCausalLM, sliding_window written as null so
    transformers' MistralConfig default (4096) does not apply."""
    case = CASES["mistral"]
    nowin = _Case("llama", case.cfg, "llama", lambda w: w.add_name("mistralai Mistral 7B Instruct v0.3"),
                  permute=True)
    _write_like_llama_cpp(tmp_path / "m.gguf", nowin)
    cfg, _ = gguf_to_hf(tmp_path / "m.gguf")
    assert cfg["architectures"] == ["MistralForCausalLM"] and cfg["sliding_window"] is None
    assert transformers.AutoConfig.for_model(**cfg).sliding_window is None


def test_gemma3_default_window_pattern(tmp_path: Path) -> None:
    """Files without attention.sliding_window_pattern: llama.cpp's (and transformers') fixed 6."""
    cfg6 = transformers.Gemma3TextConfig(vocab_size=len(_vocab("gemma")[0]), head_dim=32,
                                         query_pre_attn_scalar=32,
                                         sliding_window=8, architectures=["Gemma3ForCausalLM"],
                                         **_common() | {"num_hidden_layers": 7})
    _write_like_llama_cpp(tmp_path / "g.gguf", _Case("gemma3", cfg6, "gemma",
                                                     lambda w: w.add_sliding_window(8),
                                                     names=_GEMMA_NAMES, norm_plus_one=True))
    cfg, _ = gguf_to_hf(tmp_path / "g.gguf")
    assert cfg["layer_types"] == cfg6.layer_types
    assert cfg["layer_types"] == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "qwen3", "phi3", "mistral"])
def test_folder_tokenizer_and_chat_template(family: str, written: dict, tmp_path: Path) -> None:
    """The converted folder's tokenizer is transformers' GGUF tokenizer (same ids, BOS where the family adds
    one); a chat template in the file is kept, and a file without one (Gemma 3 270M base) converts fine and
    says so when asked to chat."""
    from transformers import AutoTokenizer

    path, _ = written[family]
    out = convert_gguf_to_hf_folder(path, tmp_path / "out", dtype=torch.float32)
    ours = AutoTokenizer.from_pretrained(out)
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in ("hello world", "hello  world hello", "world"):
        assert ours(text).input_ids == ref(text).input_ids, text
    cfg = json.loads((out / "config.json").read_text())
    first = ours("hello world").input_ids[0]
    assert (first == cfg["bos_token_id"]) == (family != "qwen3")  # SentencePiece files add BOS; Qwen's do not
    msgs = [{"role": "user", "content": "hello"}]
    if family == "qwen3":
        chat = ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert chat == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    elif family == "phi3":
        chat = ours.apply_chat_template(msgs, tokenize=False)
        assert chat.startswith("<|user|>\nhello<|end|>\n<|assistant|>")
    else:
        assert not ours.chat_template
        with pytest.raises(ValueError, match="chat template"):
            ours.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    # generation stops on eos, and in a chat model on its end-of-turn token too (Phi-3's <|end|>; ChatML's
    # <|im_end|> is already the eos)
    gen = json.loads((out / "generation_config.json").read_text())
    end = ours.convert_tokens_to_ids("<|end|>")
    assert gen["eos_token_id"] == [cfg["eos_token_id"]] + ([end] if family == "phi3" else [])


def test_unsupported_architecture_is_one_line(tmp_path: Path) -> None:
    w = GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError) as e:
        gguf_to_hf(tmp_path / "m.gguf")
    msg = str(e.value)
    assert "\n" not in msg and "'mamba'" in msg
    assert all(a in msg for a in ("gemma3", "llama", "phi3", "qwen2", "qwen3"))


def test_progress_bar_only_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Conversion shows a bar over the tensors on a terminal, and writes nothing into a log."""
    import io

    from tdpipe.model import gguf

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for stream, shown in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr("sys.stderr", stream)
        assert list(gguf._progress(iter(range(3)), 3, "m.gguf")) == [0, 1, 2]
        assert ("converting m.gguf" in stream.getvalue()) == shown
        assert shown or stream.getvalue() == ""


def test_unknown_rope_freqs_are_refused(tmp_path: Path) -> None:
    """rope_freqs that no Llama 3 setting reproduces: refused, never run with a guessed rope."""
    odd = np.linspace(1.0, 3.0, 8, dtype=np.float32)
    case = _Case("llama", CASES["llama3"].cfg, "llama", lambda w: w.add_tensor("rope_freqs.weight", odd),
                 permute=True)
    _write_like_llama_cpp(tmp_path / "l.gguf", case)
    with pytest.raises(ValueError, match="rope_freqs .* match no known Llama 3 rope settings"):
        gguf_to_hf(tmp_path / "l.gguf")
