"""SmoothQuant (Xiao et al., 2023) for `--quantization w8a8`: move activation outliers into the weights, offline.

W8A8 quantises each token's activations with one scale (`model/int8_linear.py`), so a few input channels
that run 10-100x larger than the rest set that scale and the other channels lose their bits. SmoothQuant
divides input channel j of a linear by s_j and multiplies the weight's column j by s_j, which leaves the
product unchanged:

    s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)        (Eq. 4; alpha = 0.5 by default)

max|X_j| comes from a calibration run over a few thousand tokens of text. The division is folded into
whatever produces the linear's input, so the smoothed checkpoint computes the same function in float (up to
its dtype's rounding) and costs nothing at run time:

- q/k/v (one input): into the norm before attention (Gemma's (1 + w): (1 + w) / s - 1, written in float32,
  which tdpipe keeps: model/layers.GemmaRMSNorm);
- gate/up (one input): into the norm before the MLP (`post_attention_layernorm`, Gemma's
  `pre_feedforward_layernorm`);
- down: into up's rows (act(gate) * up is linear in up);
- o: into v's rows (attention output is linear in V), one s per (kv head, dim) shared by its GQA group.

The result is an ordinary checkpoint folder (the way vLLM users run llm-compressor's SmoothQuantModifier
before serving W8A8); `tdpipe smoothquant` writes it. The calibration forward runs transformers' model in
float32, the same model the tests use as the oracle.
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: the CLI parser reads the defaults below without it
    import torch
    from torch import nn

DEFAULT_ALPHA = 0.5  # the paper's migration strength for most models (§4.2)
DEFAULT_TOKENS = 4096  # calibration tokens; more changed perplexity by < 0.1% on the bundled model
WINDOW = 512  # tokens per calibration forward
CALIBRATION_TEXT = Path(__file__).with_name("data") / "calibration.txt"  # tdpipe's docs: prose, tables, code


@dataclass(frozen=True)
class LayerNames:
    """Where a family keeps what SmoothQuant reads and folds, relative to one decoder layer."""

    attn_norm: str
    mlp_norm: str
    qkv: tuple[str, ...]  # linears reading the attention norm's output (one fused, or q, k, v)
    gate_up: tuple[str, ...]  # linears reading the MLP norm's output
    up_rows: tuple[str, int]  # the linear whose rows produce up, and the row where up starts
    down: str
    o: str
    v_rows: tuple[str, int]  # the linear whose rows produce v, and the row where v starts
    gemma_norm: bool  # norms multiply by (1 + w)


def layer_names(model: nn.Module) -> LayerNames:
    """The family's layout, from transformers' model: an error naming the architecture if unknown."""
    cfg = model.config
    kind = cfg.model_type
    inter, kv = cfg.intermediate_size, cfg.num_key_value_heads * _head_dim(cfg)
    if kind in ("llama", "mistral", "qwen2", "qwen3", "gemma3_text"):
        gemma = kind == "gemma3_text"
        return LayerNames("input_layernorm", "pre_feedforward_layernorm" if gemma else "post_attention_layernorm",
                          ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                          ("mlp.gate_proj", "mlp.up_proj"), ("mlp.up_proj", 0), "mlp.down_proj", "self_attn.o_proj",
                          ("self_attn.v_proj", 0), gemma)
    if kind == "phi3":
        q = cfg.num_attention_heads * _head_dim(cfg)
        return LayerNames("input_layernorm", "post_attention_layernorm", ("self_attn.qkv_proj",),
                          ("mlp.gate_up_proj",), ("mlp.gate_up_proj", inter), "mlp.down_proj", "self_attn.o_proj",
                          ("self_attn.qkv_proj", q + kv), False)
    raise ValueError(f"smoothquant: model type {kind!r} is not supported; supported: gemma3_text, llama, "
                     "mistral, phi3, qwen2, qwen3")


def _head_dim(cfg: object) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def calibration_windows(token_ids: list[int], tokens: int = DEFAULT_TOKENS, window: int = WINDOW) -> Iterator[list[int]]:
    """The first `tokens` ids in windows of `window` (the last may be shorter)."""
    ids = token_ids[:tokens]
    for i in range(0, len(ids), window):
        yield ids[i:i + window]


def activation_maxima(model: nn.Module, windows: Iterator[list[int]]) -> dict[str, torch.Tensor]:
    """max |x_j| over the calibration tokens of every decoder linear's input, keyed by the linear's name."""
    import torch
    from torch import nn

    maxima: dict[str, torch.Tensor] = {}

    def record(name: str):
        def hook(_: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0).float()
            maxima[name] = torch.maximum(maxima[name], x) if name in maxima else x
        return hook

    handles = [m.register_forward_pre_hook(record(n)) for n, m in _decoder(model).named_modules()
               if isinstance(m, nn.Linear)]
    try:
        with torch.no_grad():
            for ids in windows:
                model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return maxima


def smoothing_scales(x_max: torch.Tensor, weights: list[torch.Tensor], alpha: float = DEFAULT_ALPHA) -> torch.Tensor:
    """s_j (Eq. 4) for one input shared by `weights` ([out, in] each): max |W_j| over all of them."""
    import torch

    w_max = torch.stack([w.detach().abs().amax(0).float() for w in weights]).amax(0)
    return (x_max.clamp(min=1e-5) ** alpha / w_max.clamp(min=1e-5) ** (1 - alpha)).clamp(min=1e-5)


def fold(model: nn.Module, maxima: dict[str, torch.Tensor], alpha: float = DEFAULT_ALPHA) -> int:
    """Apply the smoothing of every decoder layer in place (float32 weights); returns the layers done."""
    import torch

    with torch.no_grad():
        return _fold(model, maxima, alpha)


def _fold(model: nn.Module, maxima: dict[str, torch.Tensor], alpha: float) -> int:
    names = layer_names(model)
    cfg = model.config
    g, d = cfg.num_attention_heads // cfg.num_key_value_heads, _head_dim(cfg)
    layers = _decoder(model).layers
    for i, layer in enumerate(layers):
        get = layer.get_submodule
        pre = f"layers.{i}."
        # attention input -> the attention norm
        qkv = [get(n) for n in names.qkv]
        s = smoothing_scales(maxima[pre + names.qkv[0]], [m.weight for m in qkv], alpha)
        _divide_norm(get(names.attn_norm), s, names.gemma_norm)
        for m in qkv:
            m.weight.mul_(s)
        # MLP input -> the MLP norm
        gu = [get(n) for n in names.gate_up]
        s = smoothing_scales(maxima[pre + names.gate_up[0]], [m.weight for m in gu], alpha)
        _divide_norm(get(names.mlp_norm), s, names.gemma_norm)
        for m in gu:
            m.weight.mul_(s)
        # down's input is act(gate) * up -> up's rows
        down = get(names.down)
        s = smoothing_scales(maxima[pre + names.down], [down.weight], alpha)
        _divide_rows(get(names.up_rows[0]), names.up_rows[1], s)
        down.weight.mul_(s)
        # o's input is softmax(.) V per query head -> v's rows, one scale per (kv head, dim)
        o = get(names.o)
        s = smoothing_scales(maxima[pre + names.o], [o.weight], alpha)
        s_kv = s.view(-1, g, d).amax(1)  # [kv heads, d]: the group's query heads read the same v rows
        _divide_rows(get(names.v_rows[0]), names.v_rows[1], s_kv.reshape(-1))
        o.weight.mul_(s_kv[:, None, :].expand(-1, g, -1).reshape(-1))
    return len(layers)


def _decoder(model: nn.Module) -> nn.Module:
    """The decoder stack (the module holding `.layers`)."""
    return model.model


def _divide_norm(norm: nn.Module, s: torch.Tensor, gemma: bool) -> None:
    w = norm.weight
    if gemma:  # y = x_hat * (1 + w)
        w.copy_((1.0 + w.float()) / s - 1.0)
    else:
        w.copy_(w.float() / s)


def _divide_rows(linear: nn.Linear, start: int, s: torch.Tensor) -> None:
    """Rows start .. start + len(s) of the weight (and bias) divided by s."""
    rows = slice(start, start + s.numel())
    linear.weight[rows].div_(s[:, None])
    if linear.bias is not None:
        linear.bias[rows].div_(s)


def check_settings(alpha: float, tokens: int) -> None:
    """The settings' ranges, checked before anything loads (the CLI calls it before a GGUF is converted)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha (--alpha) must be in [0, 1], got {alpha}")
    if tokens < 1:
        raise ValueError(f"tokens (--tokens) must be positive, got {tokens}")


def smooth_checkpoint(folder: str, output: str, text: str | None = None, alpha: float = DEFAULT_ALPHA,
                      tokens: int = DEFAULT_TOKENS) -> dict:
    """Write `folder`'s checkpoint, smoothed, to `output` (weights in the source's dtype, tokenizer and chat
    template copied); returns what was done."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_settings(alpha, tokens)
    if os.path.realpath(folder) == os.path.realpath(output):
        raise ValueError(f"output {output!r} is the source folder; choose another")
    src_dtype = _checkpoint_dtype(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    names = layer_names(model)  # an unsupported family fails before the calibration run
    text = text if text is not None else CALIBRATION_TEXT.read_text(encoding="utf-8")
    ids = tok(text, add_special_tokens=False).input_ids
    if tok.bos_token_id is not None:
        ids = [tok.bos_token_id, *ids]
    maxima = activation_maxima(model, calibration_windows(ids, tokens))
    layers = fold(model, maxima, alpha)
    gemma_norms = {n: m.weight.data for n, m in model.named_modules()
                   if names.gemma_norm and n.endswith((names.attn_norm, names.mlp_norm))}
    model.to(src_dtype)
    for n, w in gemma_norms.items():  # float32: (1 + w) / s - 1 needs more bits near -1 than bf16 keeps
        model.get_submodule(n).weight.data = w
    model.save_pretrained(output)
    for f in os.listdir(folder):
        if "token" in f or f.endswith(".jinja") or f in ("generation_config.json", "special_tokens_map.json"):
            shutil.copy(os.path.join(folder, f), output)
    return {"source": folder, "output": output, "alpha": alpha, "calibration_tokens": min(tokens, len(ids)),
            "layers": layers, "dtype": str(src_dtype).removeprefix("torch.")}


def _checkpoint_dtype(folder: str) -> torch.dtype:
    """The dtype config.json declares (bf16 when it declares none): the smoothed copy is written in it."""
    import json

    import torch

    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    name = cfg.get("dtype") or cfg.get("torch_dtype") or cfg.get("text_config", {}).get("torch_dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.bfloat16
