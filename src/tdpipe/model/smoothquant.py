"""SmoothQuant (Xiao et al., 2023) for `--quantization w8a8`: move activation outliers into the weights, offline.

W8A8 quantises each token's activations with one scale (`model/int8_linear.py`), so a few input channels
that run 10-100x larger than the rest set that scale and the other channels lose their bits. SmoothQuant
divides input channel j of a linear by s_j and multiplies the weight's column j by s_j, which leaves the
product unchanged:

    s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)        (Eq. 4; the paper's alpha is 0.5)

max|X_j| comes from a calibration run over a few thousand tokens of text. The division is folded into
whatever produces the linear's input, so the smoothed checkpoint computes the same function in float (up to
its dtype's rounding) and costs nothing at run time:

- q/k/v (one input): into the norm before attention (Gemma's (1 + w): (1 + w) / s - 1, written in float32,
  which tdpipe keeps: model/layers.GemmaRMSNorm);
- gate/up (one input): into the norm before the MLP (`post_attention_layernorm`, Gemma's
  `pre_feedforward_layernorm`);
- down: into up's rows (act(gate) * up is linear in up);
- o: into v's rows (attention output is linear in V), one s per (kv head, dim) shared by its GQA group.

alpha trades the activations' range against the weights'. `--alpha auto` picks it per layer and per input
(qkv, gate/up, down, o) from a grid, the one whose fake-quantised outputs (activations per token, weights per
output channel, int8 as W8A8 runs them) come closest to the float outputs on a sample of the calibration
rows, in squared error: AWQ's grid search (Lin et al., 2024, §3.2) with SmoothQuant's scales and W8A8's
error. The inputs are the float model's, so each search is independent of the others (a fold leaves the
float function unchanged).

The result is an ordinary checkpoint folder (the way vLLM users run llm-compressor's SmoothQuantModifier
before serving W8A8); `tdpipe smoothquant` writes it. The calibration forward runs transformers' model in
float32, the same model the tests use as the oracle.
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: the CLI parser reads the defaults below without it
    import torch
    from torch import nn

PAPER_ALPHA = 0.5  # the paper's migration strength for most models (§4.2)
AUTO = "auto"  # --alpha auto: the grid search of choose_alphas
DEFAULT_ALPHA: float | str = AUTO  # within 1% of bf16 perplexity on SmolLM2 and Gemma 3 (0.5: Gemma +2%)
ALPHA_GRID = tuple(i / 20 for i in range(21))  # `--alpha auto`: 0, 0.05, ..., 1
SEARCH_ROWS = 1024  # calibration rows each `--alpha auto` search scores (a strided sample)
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
    if kind in ("llama", "mistral", "qwen2", "qwen3", "granite", "gemma", "gemma2", "gemma3_text"):
        gemma = kind in ("gemma", "gemma2", "gemma3_text")
        sandwich = kind in ("gemma2", "gemma3_text")  # their post_attention_layernorm is on the attention's output
        return LayerNames("input_layernorm", "pre_feedforward_layernorm" if sandwich else "post_attention_layernorm",
                          ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                          ("mlp.gate_proj", "mlp.up_proj"), ("mlp.up_proj", 0), "mlp.down_proj", "self_attn.o_proj",
                          ("self_attn.v_proj", 0), gemma)
    if kind == "phi3":
        q = cfg.num_attention_heads * _head_dim(cfg)
        return LayerNames("input_layernorm", "post_attention_layernorm", ("self_attn.qkv_proj",),
                          ("mlp.gate_up_proj",), ("mlp.gate_up_proj", inter), "mlp.down_proj", "self_attn.o_proj",
                          ("self_attn.qkv_proj", q + kv), False)
    raise ValueError(f"smoothquant: model type {kind!r} is not supported; supported: gemma, gemma2, gemma3_text, "
                     "granite, llama, mistral, phi3, qwen2, qwen3")


def _head_dim(cfg: object) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def calibration_windows(token_ids: list[int], tokens: int = DEFAULT_TOKENS, window: int = WINDOW) -> Iterator[list[int]]:
    """The first `tokens` ids in windows of `window` (the last may be shorter)."""
    ids = token_ids[:tokens]
    for i in range(0, len(ids), window):
        yield ids[i:i + window]


def activation_maxima(model: nn.Module, windows: Iterator[list[int]]) -> dict[str, torch.Tensor]:
    """max |x_j| over the calibration tokens of every decoder linear's input, keyed by the linear's name."""
    return calibrate(model, windows)[0]


def calibrate(model: nn.Module, windows: Iterator[list[int]], stride: int = 0
              ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(max |x_j| of every decoder linear's input, and with stride > 0 every stride-th input row [rows, in] of
    the linears whose input a fold scales: the first of qkv and of gate/up, down, o), keyed by linear name."""
    import torch
    from torch import nn

    maxima: dict[str, torch.Tensor] = {}
    rows: dict[str, list[torch.Tensor]] = {}
    names = layer_names(model)
    sampled = (names.qkv[0], names.gate_up[0], names.down, names.o) if stride > 0 else ()

    def record(name: str):
        keep = name.split(".", 2)[-1] in sampled

        def hook(_: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            m = x.abs().amax(0)
            maxima[name] = torch.maximum(maxima[name], m) if name in maxima else m
            if keep:
                rows.setdefault(name, []).append(x[::stride].clone())
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
    return maxima, {k: torch.cat(v) for k, v in rows.items()}


def smoothing_scales(x_max: torch.Tensor, weights: list[torch.Tensor], alpha: float = PAPER_ALPHA) -> torch.Tensor:
    """s_j (Eq. 4) for one input shared by `weights` ([out, in] each): max |W_j| over all of them."""
    import torch

    w_max = torch.stack([w.detach().abs().amax(0).float() for w in weights]).amax(0)
    return (x_max.clamp(min=1e-5) ** alpha / w_max.clamp(min=1e-5) ** (1 - alpha)).clamp(min=1e-5)


def fake_quant_rows(x: torch.Tensor) -> torch.Tensor:
    """x through W8A8's own int8 round trip (model/int8_linear.quantize_rows: one symmetric scale per row, of
    x R where the engine rotates; rotated back after, R being its own inverse), so that fake-quantised
    activations times fake-quantised weights are the engine's output."""
    from tdpipe.model import int8_linear as il

    rotate = il.rotates(x.shape[-1])
    q, scale = il.quantize_rows(x.float().contiguous(), rotate)
    y = q.float() * scale[:, None]
    return il.rotate64(y) if rotate else y


def w8a8_error(x: torch.Tensor, weights: list[torch.Tensor], s: torch.Tensor,
               exact: list[torch.Tensor] | None = None) -> float:
    """Squared error of W8A8 outputs, inputs x / s and weights W s, against the float x W^T over `weights`
    (`exact`: those float outputs, when the caller has them)."""
    xq = fake_quant_rows(x / s)
    exact = exact or [x @ w.float().T for w in weights]
    return sum(float(((xq @ fake_quant_rows(w.float() * s).T) - y).square().sum()) for w, y in zip(weights, exact))


def search_alpha(x: torch.Tensor, weights: list[torch.Tensor], x_max: torch.Tensor,
                 grid: tuple[float, ...] = ALPHA_GRID, gqa: tuple[int, int] | None = None) -> float:
    """The alpha of `grid` whose scales give the least w8a8_error on the sample x (ties: the first). With
    gqa = (group, head_dim) the scales are collapsed per kv head, as the fold into v's rows needs."""
    exact = [x @ w.float().T for w in weights]
    errors = [w8a8_error(x, weights, _group_scales(smoothing_scales(x_max, weights, a), gqa), exact) for a in grid]
    return grid[min(range(len(grid)), key=errors.__getitem__)]


def _group_scales(s: torch.Tensor, gqa: tuple[int, int] | None) -> torch.Tensor:
    """s as applied to o's columns: one scale per (kv head, dim), the max over its query heads."""
    if gqa is None:
        return s
    g, d = gqa
    return s.view(-1, g, d).amax(1)[:, None, :].expand(-1, g, -1).reshape(-1)


def fold(model: nn.Module, maxima: dict[str, torch.Tensor], alpha: float | dict[str, float] = PAPER_ALPHA) -> int:
    """Apply the smoothing of every decoder layer in place (float32 weights); returns the layers done. `alpha`
    is one value, or one per scaled input keyed by its first linear's name (choose_alphas)."""
    import torch

    with torch.no_grad():
        return _fold(model, maxima, alpha)


def choose_alphas(model: nn.Module, maxima: dict[str, torch.Tensor], samples: dict[str, torch.Tensor],
                  grid: tuple[float, ...] = ALPHA_GRID) -> dict[str, float]:
    """`--alpha auto`: search_alpha for every scaled input of every layer, keyed by its first linear's name."""
    import torch

    names = layer_names(model)
    gqa = _gqa(model.config)
    chosen = {}
    with torch.no_grad():
        for i, layer in enumerate(_decoder(model).layers):
            for group in (names.qkv, names.gate_up, (names.down,), (names.o,)):
                key = f"layers.{i}.{group[0]}"
                ws = [layer.get_submodule(n).weight for n in group]
                chosen[key] = search_alpha(samples[key], ws, maxima[key], grid, gqa if group[0] == names.o else None)
    return chosen


def _gqa(cfg: object) -> tuple[int, int]:
    return cfg.num_attention_heads // cfg.num_key_value_heads, _head_dim(cfg)


def _fold(model: nn.Module, maxima: dict[str, torch.Tensor], alpha: float | dict[str, float]) -> int:
    names = layer_names(model)
    gqa = _gqa(model.config)
    layers = _decoder(model).layers

    def scales(key: str, weights: list[torch.Tensor]) -> torch.Tensor:
        return smoothing_scales(maxima[key], weights, alpha[key] if isinstance(alpha, dict) else alpha)

    for i, layer in enumerate(layers):
        get = layer.get_submodule
        pre = f"layers.{i}."
        # attention input -> the attention norm
        qkv = [get(n) for n in names.qkv]
        s = scales(pre + names.qkv[0], [m.weight for m in qkv])
        _divide_norm(get(names.attn_norm), s, names.gemma_norm)
        for m in qkv:
            m.weight.mul_(s)
        # MLP input -> the MLP norm
        gu = [get(n) for n in names.gate_up]
        s = scales(pre + names.gate_up[0], [m.weight for m in gu])
        _divide_norm(get(names.mlp_norm), s, names.gemma_norm)
        for m in gu:
            m.weight.mul_(s)
        # down's input is act(gate) * up -> up's rows
        down = get(names.down)
        s = scales(pre + names.down, [down.weight])
        _divide_rows(get(names.up_rows[0]), names.up_rows[1], s)
        down.weight.mul_(s)
        # o's input is softmax(.) V per query head -> v's rows, one scale per (kv head, dim)
        o = get(names.o)
        s = _group_scales(scales(pre + names.o, [o.weight]), gqa)  # the group's query heads read the same v rows
        _divide_rows(get(names.v_rows[0]), names.v_rows[1], s.view(-1, gqa[0], gqa[1])[:, 0, :].reshape(-1))
        o.weight.mul_(s)
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


def parse_alpha(text: str) -> float | str:
    """--alpha's value: a number, or "auto" (the per-layer search)."""
    return AUTO if text.strip().lower() == AUTO else float(text)


def check_settings(alpha: float | str, tokens: int) -> None:
    """The settings' ranges, checked before anything loads (the CLI calls it before a GGUF is converted)."""
    if alpha != AUTO and not (isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"alpha (--alpha) must be in [0, 1] or {AUTO!r}, got {alpha!r}")
    if tokens < 1:
        raise ValueError(f"tokens (--tokens) must be positive, got {tokens}")


def smooth_checkpoint(folder: str, output: str, text: str | None = None, alpha: float | str = DEFAULT_ALPHA,
                      tokens: int = DEFAULT_TOKENS) -> dict:
    """Write `folder`'s checkpoint, smoothed, to `output` (weights in the source's dtype, tokenizer and chat
    template copied); returns what was done (with alpha "auto", the alphas chosen, also written to the
    folder's smoothquant.json)."""
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
    n_tokens = min(tokens, len(ids))
    maxima, samples = calibrate(model, calibration_windows(ids, tokens),
                                stride=max(1, n_tokens // SEARCH_ROWS) if alpha == AUTO else 0)
    alphas = choose_alphas(model, maxima, samples) if alpha == AUTO else alpha
    layers = fold(model, maxima, alphas)
    gemma_norms = {n: m.weight.data for n, m in model.named_modules()
                   if names.gemma_norm and n.endswith((names.attn_norm, names.mlp_norm))}
    model.to(src_dtype)
    for n, w in gemma_norms.items():  # float32: (1 + w) / s - 1 needs more bits near -1 than bf16 keeps
        model.get_submodule(n).weight.data = w
    model.save_pretrained(output)
    for f in os.listdir(folder):
        if "token" in f or f.endswith(".jinja") or f in ("generation_config.json", "special_tokens_map.json"):
            shutil.copy(os.path.join(folder, f), output)
    report = {"source": folder, "output": output, "alpha": alpha, "calibration_tokens": n_tokens, "layers": layers,
              "dtype": str(src_dtype).removeprefix("torch.")}
    if isinstance(alphas, dict):
        with open(os.path.join(output, "smoothquant.json"), "w", encoding="utf-8") as f:
            json.dump({**report, "alphas": alphas}, f, indent=1)
        report["alpha_mean"] = round(sum(alphas.values()) / len(alphas), 3)
    return report


def _checkpoint_dtype(folder: str) -> torch.dtype:
    """The dtype config.json declares (bf16 when it declares none): the smoothed copy is written in it."""
    import torch

    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    name = cfg.get("dtype") or cfg.get("torch_dtype") or cfg.get("text_config", {}).get("torch_dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.bfloat16
