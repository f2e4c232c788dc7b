"""The Hugging Face architectures tdpipe runs, and how each family's config.json maps onto ModelConfig.

One table (FAMILIES) says what sets a family's decoder apart from Llama's; the model (model/llama.py) reads
only the resulting ModelConfig fields, so a family is a row here, not a model class. Defaults for keys a
config.json leaves out are transformers' own (a missing Mistral `sliding_window` means 4096 there, so here).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Family:
    """What a family changes against Llama (the defaults)."""

    qkv_bias: bool = False  # biases on q, k and v whatever attention_bias says (Qwen2)
    # which of config.json's attention_bias (q, k, v and o) and mlp_bias (gate, up, down) keys the family
    # reads, as transformers does: both in Llama, attention_bias in Qwen3 and Gemma 3; Mistral, Qwen2 and Phi-3
    # fix their biases whatever the keys say
    bias_keys: tuple[str, ...] = ("attention_bias",)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before rope (Qwen3, Gemma 3)
    norm: str = "rms"  # "rms": w * x (Llama); "gemma": x * (1 + w), multiplied in float32 (Gemma 3)
    sandwich_norms: bool = False  # norms after attention and around the MLP (Gemma 2/3)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    windows: str = "none"  # which layers slide: none | all (Mistral, Phi-3) | qwen | gemma
    local_rope: bool = False  # the sliding layers turn with a base of their own (Gemma 3's rope_local_base_freq)
    # Granite's four scalars: embedding_multiplier, attention_multiplier (the softmax scale),
    # residual_multiplier (on each attention and MLP output) and logits_scaling (the logits divided by it)
    multipliers: bool = False
    defaults: dict[str, Any] = field(default_factory=dict)  # transformers' defaults for absent keys
    # activation names the family's transformers config rewrites (Gemma: the legacy "gelu" means the tanh one)
    act_aliases: dict[str, str] = field(default_factory=dict)


_GEMMA3 = Family(qk_norm=True, norm="gemma", sandwich_norms=True, embed_scale=True, windows="gemma", local_rope=True,
                 defaults={
    # Gemma3TextConfig's defaults (a Gemma3ForConditionalGeneration text_config leaves most of them out)
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131_072, "tie_word_embeddings": True, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0, "hidden_activation": "gelu_pytorch_tanh", "eos_token_id": 1,
    "bos_token_id": 2})

# Gemma 2: Gemma 3's layer without q/k norms, every other layer sliding (the first one slides), the attention
# scores soft-capped (attn_logit_softcapping) and the logits too (final_logit_softcapping)
_GEMMA2 = Family(norm="gemma", sandwich_norms=True, embed_scale=True, windows="gemma", defaults={
    # Gemma2Config's defaults
    "vocab_size": 256_000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 8192, "tie_word_embeddings": True, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "sliding_window_pattern": 2, "rope_theta": 10_000.0,
    "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
    "eos_token_id": 1, "bos_token_id": 2})

# Gemma 1: Gemma's norms, scaled embeddings and GeGLU on Llama's layer, every layer global
_GEMMA = Family(norm="gemma", embed_scale=True, act_aliases={"gelu": "gelu_pytorch_tanh"}, defaults={
    "hidden_act": "gelu_pytorch_tanh", "head_dim": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": True})

FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(bias_keys=("attention_bias", "mlp_bias")),
    "MistralForCausalLM": Family(windows="all", bias_keys=(), defaults={"sliding_window": 4096}),
    "Qwen2ForCausalLM": Family(qkv_bias=True, bias_keys=(), windows="qwen"),
    "Qwen3ForCausalLM": Family(qk_norm=True, windows="qwen"),
    "GemmaForCausalLM": _GEMMA,
    "Gemma2ForCausalLM": _GEMMA2,
    "Gemma3ForCausalLM": _GEMMA3,
    "Gemma3ForConditionalGeneration": _GEMMA3,  # its text_config; the vision tower is not loaded
    "Phi3ForCausalLM": Family(windows="all", bias_keys=(), defaults={"sliding_window": None}),
    "GraniteForCausalLM": Family(bias_keys=("attention_bias", "mlp_bias"), multipliers=True),
}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the gated MLP's activation (model/cpu_ops.py)
ROPE_TYPES = ("llama3", "linear", "longrope")  # besides plain rope (model/layers.py: rope_inv_freq)


def family_of(hf: dict[str, Any]) -> tuple[str, Family, dict[str, Any]]:
    """(architecture, its Family, the config's decoder keys over the family's defaults); an unsupported
    architecture is one error naming it and the supported ones."""
    arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch not in FAMILIES:
        raise ValueError(f"model architecture {arch!r} is not supported; supported: {', '.join(sorted(FAMILIES))}")
    fam = FAMILIES[arch]
    keys = {**hf.get("text_config", {}), **{k: hf[k] for k in ("eos_token_id", "bos_token_id") if k in hf}} \
        if arch == "Gemma3ForConditionalGeneration" else hf
    return arch, fam, {**fam.defaults, **keys}


def biases(fam: Family, hf: dict[str, Any]) -> tuple[bool, bool, bool]:
    """Whether (q/k/v, o_proj, gate/up/down) carry biases, by transformers' rule for the family (Family.bias_keys;
    Qwen2 has q/k/v biases only)."""
    attn, mlp = (k in fam.bias_keys and bool(hf.get(k, False)) for k in ("attention_bias", "mlp_bias"))
    return fam.qkv_bias or attn, attn, mlp


def layer_windows(fam: Family, hf: dict[str, Any], num_layers: int) -> list[int | None]:
    """Per layer: the sliding window of the last W keys, or None (global), as transformers decides it."""
    w = hf.get("sliding_window")
    if fam.windows == "none" or w is None:
        return [None] * num_layers
    if fam.windows == "all":
        return [int(w)] * num_layers
    if fam.windows == "qwen" and not hf.get("use_sliding_window", False):
        return [None] * num_layers
    types = hf.get("layer_types")
    if types is None and fam.windows == "qwen":  # Qwen2/3: the layers from max_window_layers on slide
        start = hf.get("max_window_layers", 28)
        types = ["sliding_attention" if i >= start else "full_attention" for i in range(num_layers)]
    if types is None:  # Gemma 3: five local layers, then a global one (sliding_window_pattern 6; Gemma 2: 2)
        n = hf.get("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types {types} must name sliding_attention or full_attention for each of the "
                         f"{num_layers} layers")
    return [int(w) if t == "sliding_attention" else None for t in types]


def rope_settings(hf: dict[str, Any], local: bool = False) -> tuple[float, dict[str, Any] | None]:
    """(rope base, scaling dict or None) of the global layers, or with `local` of Gemma 3's sliding ones
    (rope_local_base_freq, never scaled). Reads transformers 4's rope_theta / rope_scaling and transformers
    5's rope_parameters (flat, or nested per layer type)."""
    params = hf.get("rope_parameters") or {}
    if any(isinstance(v, dict) for v in params.values()):  # per layer type
        params = params.get("sliding_attention" if local else "full_attention") or {}
        theta, scaling = params.get("rope_theta"), params
    elif local:
        theta, scaling = hf.get("rope_local_base_freq"), None
    else:
        theta, scaling = params.get("rope_theta", hf.get("rope_theta")), hf.get("rope_scaling") or params
    theta = 10000.0 if theta is None else float(theta)
    if not scaling:
        return theta, None
    scaling = dict(scaling)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    rope_type = "longrope" if rope_type == "su" else rope_type  # Phi-3's old name
    if rope_type == "default":
        return theta, None
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)} "
                         "or none")
    scaling["rope_type"] = rope_type
    if rope_type == "longrope":  # Phi-3 keeps the pretraining length outside the rope settings
        orig = hf.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings") \
            or hf.get("max_position_embeddings", 4096)
        scaling["original_max_position_embeddings"] = int(orig)
        if scaling.get("factor") is None:
            scaling["factor"] = hf.get("max_position_embeddings", orig) / orig
    return theta, scaling


def partial_rotary_factor(hf: dict[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    return float(hf.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0)


__all__ = ["ACTIVATIONS", "FAMILIES", "Family", "ROPE_TYPES", "biases", "family_of", "layer_windows", "partial_rotary_factor",
           "rope_settings"]
