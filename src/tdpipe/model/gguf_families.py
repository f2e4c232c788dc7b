"""What llama.cpp wrote, per architecture, and the Hugging Face config and names it came from.

A GGUF file states its architecture (``general.architecture``) and its shape under ``{arch}.*`` keys; its
tensors use llama.cpp's names (``blk.N.attn_q``...) and some carry a transform llama.cpp's converter
(convert_hf_to_gguf.py) applied. One table (``FAMILIES``) says, per architecture, which HF class and
names the tensors go back to and which transform to undo; ``hf_config`` rebuilds the config.json that
class reads. transformers' own GGUF loader (modeling_gguf_pytorch_utils.py, integrations/ggml.py) is the
oracle: for the keys it maps, the values here are the ones it builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from gguf.quants import dequantize

_REQUIRED = object()


class Meta:
    """A GGUFReader's metadata, read key by key (the vocabulary arrays are large: never read whole here)."""

    def __init__(self, reader: Any, arch: str) -> None:
        self.fields, self.arch = reader.fields, arch
        self.tensors = {t.name: t for t in reader.tensors}
        self.tensor_names = set(self.tensors)

    def get(self, key: str, default: Any = None) -> Any:
        f = self.fields.get(key)
        return default if f is None else f.contents()

    def key(self, name: str, default: Any = _REQUIRED) -> Any:
        """``{arch}.{name}``; a missing key without a default is an error naming it."""
        value = self.get(f"{self.arch}.{name}", None if default is _REQUIRED else default)
        if value is None and default is _REQUIRED:
            raise ValueError(f"GGUF file lacks required metadata {self.arch}.{name}")
        return value


# GGUF block tensor part -> HF sub-module, shared by the Llama-shaped families.
_DECODER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma 2/3: a norm after attention and one on each side of the MLP
_SANDWICH_NAMES = {**_DECODER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                   "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Phi-3's LongRoPE factors and Llama 3's per-frequency factors are tensors in the file and numbers in HF's
# rope_scaling (see _phi3, _llama3_scaling): read into the config, not written as weights.
ROPE_FACTOR_TENSORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}
ROPE_FREQS = "rope_freqs.weight"
# Llama 3's rope settings that llama.cpp's converter folds into rope_freqs: the published ones first
_LLAMA3_GRID = [(low, high, orig) for orig in (8192, 4096, 16384, 32768, 2048) for low in (1.0, 2.0)
                for high in (4.0, 2.0, 8.0) if high > low]


def _rope_scaling(meta: Meta) -> dict[str, Any] | None:
    """Linear / YaRN scaling as llama.cpp stores it (``{arch}.rope.scaling.*``), in HF's rope_scaling form."""
    kind = meta.key("rope.scaling.type", None)
    if kind in (None, "none"):
        return None
    out: dict[str, Any] = {"rope_type": kind, "factor": float(meta.key("rope.scaling.factor", 1.0))}
    orig = meta.key("rope.scaling.original_context_length", None)
    if orig is not None:
        out["original_max_position_embeddings"] = int(orig)
    return out


def _pad_id(meta: Meta) -> int | None:
    """Written even when absent: HF configs default to one checkpoint's id (Phi-3: 32000), which may lie
    past a smaller vocabulary."""
    return meta.get("tokenizer.ggml.padding_token_id")


def _llama3_factors(theta: float, dim: int, factor: float, low: float, high: float, orig: int) -> np.ndarray:
    """rope_freqs as llama.cpp's LlamaModel.generate_extra_tensors computes it from HF's llama3 settings."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    wavelen = 2 * np.pi / freqs.astype(np.float64)
    smooth = (orig / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, mid))
    return out.astype(np.float32)


def _llama3_scaling(meta: Meta, head_dim: int) -> dict[str, Any]:
    """HF's llama3 rope_scaling back from the rope_freqs tensor llama.cpp wrote in its place (Llama 3.1+): the
    factor is the tensor's largest entry; the other three settings are the candidates whose factors it
    reproduces exactly, else the file is refused rather than run with a guessed rope."""
    t = meta.tensors[ROPE_FREQS]
    got = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(-1)
    theta = float(meta.key("rope.freq_base", 10000.0))
    factor = float(got.max())
    for low, high, orig in _LLAMA3_GRID:
        if np.allclose(_llama3_factors(theta, head_dim, factor, low, high, orig), got, rtol=1e-5, atol=0):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": orig}
    raise ValueError("the file's rope_freqs (llama3 rope scaling) match no known Llama 3 rope settings")


def _llama(meta: Meta) -> dict[str, Any]:
    out: dict[str, Any] = {"attention_bias": "blk.0.attn_q.bias" in meta.tensor_names,
                           "mlp_bias": "blk.0.ffn_down.bias" in meta.tensor_names}
    if ROPE_FREQS in meta.tensors:
        hidden, heads = int(meta.key("embedding_length")), int(meta.key("attention.head_count"))
        out["rope_scaling"] = _llama3_scaling(meta, int(meta.key("rope.dimension_count", hidden // heads)))
    return out


def _mistral(meta: Meta) -> dict[str, Any]:
    # Always written: MistralConfig's default window (4096, Mistral 7B v0.1's) would apply to a file
    # without one.
    window = meta.key("attention.sliding_window", None)
    return {**_llama(meta), "sliding_window": int(window) if window else None}


def _granite(meta: Meta) -> dict[str, Any]:
    """Granite: Llama's layer (q/k rows permuted as Llama's) and its four multipliers, which llama.cpp's
    converter writes as *_scale keys only where the config set them; an absent one is the config's default,
    1.0 (the value the model was trained with)."""
    def scale(key: str) -> float:  # float32 in the file: its shortest decimal is the config's value (0.2)
        value = meta.key(key, None)
        return float(str(np.float32(value))) if value else 1.0

    return {**_llama(meta), "embedding_multiplier": scale("embedding_scale"),
            "attention_multiplier": scale("attention.scale"), "residual_multiplier": scale("residual_scale"),
            "logits_scaling": scale("logit_scale"), "pad_token_id": _pad_id(meta)}


def _qwen3(meta: Meta) -> dict[str, Any]:
    return {"attention_bias": False, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": int(meta.key("block_count")), "pad_token_id": _pad_id(meta)}


def _phi3(meta: Meta) -> dict[str, Any]:
    window = meta.key("attention.sliding_window", None)
    out: dict[str, Any] = {"sliding_window": int(window) if window else None, "attention_bias": False,
                           "pad_token_id": _pad_id(meta)}
    orig = meta.key("rope.scaling.original_context_length", None)
    if orig is not None:
        out["original_max_position_embeddings"] = int(orig)
    factors = {hf: meta.tensors[name] for name, hf in ROPE_FACTOR_TENSORS.items() if name in meta.tensors}
    if factors:  # LongRoPE: llama.cpp keeps HF's factor lists as two F32 tensors
        if len(factors) != 2:
            raise ValueError("GGUF phi3 file has only one of rope_factors_long / rope_factors_short")
        out["rope_scaling"] = {"rope_type": "longrope",
                               **{k: [float(x) for x in dequantize(t.data, t.tensor_type).reshape(-1)]
                                  for k, t in sorted(factors.items())}}
    return out


def _gemma3_layer_types(meta: Meta, layers: int) -> list[str]:
    """Per layer, sliding or full attention. Newer files state the pattern (an int n: every n-th layer is
    global, or one bool per layer: True = sliding); older ones rely on llama.cpp's fixed n = 6, as does
    transformers' Gemma3TextConfig."""
    pattern = meta.key("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(f"{meta.arch}.attention.sliding_window_pattern has {len(pattern)} entries; "
                             f"the model has {layers} layers")
        return ["sliding_attention" if p else "full_attention" for p in pattern]
    n = int(pattern)
    return ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(layers)]


GEMMA2_27B_LAYERS, GEMMA3_27B_LAYERS = 46, 62  # llama.cpp tells its 27B models apart by layer count


def derived_query_pre_attn_scalar(layers: int, hidden: int, heads: int, head_dim: int, layers_27b: int) -> int:
    """What llama.cpp scales Gemma 2/3's attention by without an attention.scale key: hidden / heads for
    the 27B models (`layers_27b` layers), head_dim for the others (gguf_export writes the key elsewhere)."""
    return hidden // heads if layers == layers_27b else head_dim


def query_pre_attn_scalar(meta: Meta, layers_27b: int) -> int | float:
    """Gemma 2/3's attention scale as llama.cpp derives it: the file's attention.scale (1/sqrt(scalar)) where
    it states one, else derived_query_pre_attn_scalar."""
    scale = meta.key("attention.scale", None)
    if scale:
        qpas = float(np.float32(1.0) / (np.float32(scale) ** 2))
        return int(round(qpas)) if abs(qpas - round(qpas)) < 1e-3 else qpas
    return derived_query_pre_attn_scalar(int(meta.key("block_count")), int(meta.key("embedding_length")),
                                         int(meta.key("attention.head_count")),
                                         int(meta.key("attention.key_length")), layers_27b)


def _gemma(meta: Meta) -> dict[str, Any]:
    """Gemma (1): Llama's layer with Gemma's norms (stored as 1 + w), GELU-tanh, the embedding scaled by
    sqrt(hidden) (HF's class does it) and rope base 10 000 unless the file says otherwise."""
    return {
        "head_dim": int(meta.key("attention.key_length")),
        "rope_theta": float(meta.key("rope.freq_base", 10_000.0)),
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "pad_token_id": _pad_id(meta),
    }


def _gemma2(meta: Meta) -> dict[str, Any]:
    """llama.cpp's converter writes the caps and the window; the layers alternate, the first one sliding,
    and rope turns with base 10 000 unless the file says otherwise (as llama.cpp reads it)."""
    layers = int(meta.key("block_count"))
    softcap = meta.key("final_logit_softcapping", None)
    attn_softcap = meta.key("attn_logit_softcapping", None)
    return {
        "head_dim": int(meta.key("attention.key_length")),
        "rope_theta": float(meta.key("rope.freq_base", 10_000.0)),
        "sliding_window": int(meta.key("attention.sliding_window")),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "query_pre_attn_scalar": query_pre_attn_scalar(meta, GEMMA2_27B_LAYERS),
        "final_logit_softcapping": float(softcap) if softcap else None,
        "attn_logit_softcapping": float(attn_softcap) if attn_softcap else None,
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "pad_token_id": _pad_id(meta),
    }


def _gemma3(meta: Meta) -> dict[str, Any]:
    layers = int(meta.key("block_count"))
    head_dim = int(meta.key("attention.key_length"))
    qpas = query_pre_attn_scalar(meta, GEMMA3_27B_LAYERS)
    softcap = meta.key("final_logit_softcapping", None)
    attn_softcap = meta.key("attn_logit_softcapping", None)
    window = meta.key("attention.sliding_window")
    return {
        "head_dim": head_dim,
        "rope_theta": float(meta.key("rope.freq_base", 1_000_000.0)),
        # llama.cpp fixes the local layers' base at 10 000 unless the file states another
        "rope_local_base_freq": float(meta.key("rope.freq_base_swa", 10_000.0)),
        "sliding_window": int(window),
        "layer_types": _gemma3_layer_types(meta, layers),
        "query_pre_attn_scalar": qpas,
        "final_logit_softcapping": float(softcap) if softcap else None,
        "attn_logit_softcapping": float(attn_softcap) if attn_softcap else None,
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_bidirectional_attention": False,
        "pad_token_id": _pad_id(meta),
    }


@dataclass(frozen=True)
class Family:
    """One GGUF architecture: the HF class it converts to, its tensor names and llama.cpp's transforms."""

    hf_arch: str
    model_type: str
    names: dict[str, str]  # GGUF block tensor part -> HF sub-module under model.layers.N
    config: Callable[[Meta], dict[str, Any]]  # the family's own config.json keys
    # llama.cpp's Llama converter reorders q/k rows for its interleaved rope (undone by unpermute_rope_rows);
    # the NeoX-rope families (Qwen, Gemma, Phi-3) are stored in HF's order
    permute_qk: bool = False
    # llama.cpp stores Gemma's RMSNorm weights as 1 + w (HF's Gemma computes x * (1 + w)); subtract it back
    norm_offset: float = 0.0
    partial_rotary: bool = False  # HF's class reads partial_rotary_factor (Phi-3)
    rope_freqs: bool = False  # a rope_freqs tensor is Llama 3's rope_scaling (see _llama3_scaling)


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", "llama", _DECODER_NAMES, _llama, permute_qk=True, rope_freqs=True),
    # llama.cpp writes Mistral as `llama` (same tensors, q/k permuted); family_of picks this entry
    "mistral": Family("MistralForCausalLM", "mistral", _DECODER_NAMES, _mistral, permute_qk=True,
                      rope_freqs=True),
    "qwen2": Family("Qwen2ForCausalLM", "qwen2", _DECODER_NAMES, lambda meta: {}),
    "granite": Family("GraniteForCausalLM", "granite", _DECODER_NAMES, _granite, permute_qk=True),
    "qwen3": Family("Qwen3ForCausalLM", "qwen3", _DECODER_NAMES | _QK_NORM_NAMES, _qwen3),
    "phi3": Family("Phi3ForCausalLM", "phi3",
                   {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                    "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
                    "ffn_up": "mlp.gate_up_proj",  # gate and up fused, gate first: HF's layout
                    "ffn_down": "mlp.down_proj"}, _phi3, partial_rotary=True),
    "gemma": Family("GemmaForCausalLM", "gemma", _DECODER_NAMES, _gemma, norm_offset=1.0),
    "gemma2": Family("Gemma2ForCausalLM", "gemma2", _SANDWICH_NAMES, _gemma2, norm_offset=1.0),
    "gemma3": Family("Gemma3ForCausalLM", "gemma3_text", _SANDWICH_NAMES | _QK_NORM_NAMES, _gemma3, norm_offset=1.0),
}
# The names llama.cpp writes in general.architecture (Mistral is written as llama).
SUPPORTED_ARCHS = sorted(set(FAMILIES) - {"mistral"})


def family_of(reader: Any) -> tuple[Meta, Family]:
    """The file's family. An unsupported architecture is one line naming it and the supported ones."""
    field_ = reader.fields.get("general.architecture")
    arch = None if field_ is None else field_.contents()
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; tdpipe converts "
                         f"{', '.join(SUPPORTED_ARCHS)} "
                         "(Mistral files are written as llama)")
    meta = Meta(reader, arch)
    if arch == "llama" and _is_mistral(meta):
        return meta, FAMILIES["mistral"]
    return meta, FAMILIES[arch]


def _is_mistral(meta: Meta) -> bool:
    """llama.cpp writes Mistral models as `llama`: a sliding window, or a name saying so, tells them apart."""
    if meta.key("attention.sliding_window", None):
        return True
    names = (meta.get("general.name"), meta.get("general.basename"), meta.get("general.architecture_name"))
    return any(isinstance(n, str) and "mistral" in n.lower() for n in names)


def hf_config(meta: Meta, family: Family) -> dict[str, Any]:
    """The config.json ``family.hf_arch`` reads: the keys every decoder shares, then the family's own."""
    hidden = int(meta.key("embedding_length"))
    heads = int(meta.key("attention.head_count"))
    head_dim = int(meta.key("attention.key_length", hidden // heads))
    rope_dim = int(meta.key("rope.dimension_count", head_dim))
    if ROPE_FREQS in meta.tensors and not family.rope_freqs:
        raise ValueError(f"GGUF {meta.arch!r} model uses rope_freqs (per-frequency rope factors); "
                         f"not supported for {family.hf_arch}")
    if rope_dim != head_dim and not family.partial_rotary:
        raise ValueError(f"partial rotary (rope dim {rope_dim} != head dim {head_dim}) is not supported for "
                         f"{family.hf_arch}")
    eps = np.float32(meta.key("attention.layer_norm_rms_epsilon"))
    vocab = meta.key("vocab_size", None)
    if vocab is None and "token_embd.weight" in meta.tensors:  # older files: count the embedding rows
        vocab = int(meta.tensors["token_embd.weight"].shape[-1])  # (GGUF shapes are reversed)
    kv_heads = meta.key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise ValueError("per-layer KV head counts are not supported")
    cfg: dict[str, Any] = {
        "architectures": [family.hf_arch],
        "model_type": family.model_type,
        "hidden_size": hidden,
        "intermediate_size": int(meta.key("feed_forward_length")),
        "num_hidden_layers": int(meta.key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        # stored as float32 in the file: round so 1e-5 is not written as 9.99999974e-06
        "rms_norm_eps": float(np.format_float_positional(eps)),
        "rope_theta": float(meta.key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.key("context_length")),
        "vocab_size": None if vocab is None else int(vocab),
        "tie_word_embeddings": "output.weight" not in meta.tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    scaling = _rope_scaling(meta)
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    if rope_dim != head_dim:  # Phi-4-mini rotates 3/4 of each head (llama.cpp: rope.dimension_count)
        cfg["partial_rotary_factor"] = rope_dim / head_dim
    cfg.update(family.config(meta))
    return cfg
