"""Building blocks of Llama-family decoders: RMSNorm, rotary embeddings (incl. llama3 scaling), SwiGLU."""
from __future__ import annotations

import math

import torch
from torch import nn

from tdpipe.model import cpu_ops as ops
from tdpipe.model.quantized_rows import QuantizedRows


class RMSNorm(nn.Module):
    """RMSNorm in float32, cast back, as transformers does; optionally fused with the residual add."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        # set when a W8A8 linear reads this norm's output (int8_linear.norm_into_linears): the output then comes
        # quantised for it, with this rotation flag; None: a tensor
        self.quantize_rotate: bool | None = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | QuantizedRows:
        """norm(x + residual); a given `residual` becomes x + residual in place (the running residual stream)."""
        if self.quantize_rotate is not None:
            qs = ops.add_rms_norm_quant(x, residual, self.weight, self.eps, self.quantize_rotate)
            if qs is not None:
                return QuantizedRows(*qs, x.dtype)
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: x * (1 + w), the product taken in float32 before the cast back (transformers'
    Gemma3RMSNorm; the checkpoint stores w around 0).

    w stays float32 whatever the model is cast to. The product is float32 anyway, so a bf16 checkpoint's
    numbers are unchanged (its values upcast exactly); a checkpoint that stores (1 + w) / s - 1 in float32
    (SmoothQuant's fold, model/smoothquant.py) keeps the bits bf16 loses near -1."""

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 (nn.Module's signature)
        before = self.weight.data
        out = super()._apply(fn, recurse)
        if before.dtype == torch.float32 and before.device.type != "meta" and self.weight.dtype != torch.float32:
            self.weight.data = before.to(device=self.weight.device)
        return out

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return ops.add_gemma_rms_norm(x, residual, self.weight, self.eps)


def make_norm(kind: str, dim: int, eps: float) -> RMSNorm:
    return GemmaRMSNorm(dim, eps) if kind == "gemma" else RMSNorm(dim, eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None, long: bool = False) -> torch.Tensor:
    """Inverse frequencies of the `head_dim` rotated dims: plain rope, or scaled as transformers'
    rope init functions do: "linear" (positions / factor), "llama3" (a ramp between short and long
    wavelengths), "longrope" (Phi-3: per-frequency short or, with `long`, long factors)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    kind = None if scaling is None else scaling["rope_type"] if "rope_type" in scaling else "llama3"
    if kind == "longrope":
        ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (ext * theta ** exponent)
    inv = 1.0 / (theta ** exponent)
    if kind is None:
        return inv
    if kind == "linear":
        return inv / scaling["factor"]
    # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_attention_factor(scaling: dict | None) -> float:
    """The factor cos and sin are multiplied by (longrope: sqrt(1 + ln(factor) / ln(original length)) unless
    the config gives attention_factor; 1 for the other kinds)."""
    if scaling is None or scaling.get("rope_type") != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]
    orig = scaling["original_max_position_embeddings"]
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))


class RotaryEmbedding(nn.Module):
    """A float32 [max_positions, rotary_dim] table of (cos | sin) over the first rotary_dim / 2 frequencies,
    applied in place to q and k by position. rotate_half's cos and sin repeat each frequency in both halves
    of a head, so a table of both halves held every value twice (64 MiB per table for Gemma 3's 32,768
    positions and 256-dim heads).

    `rotary_dim` < head_dim (partial rotary, Phi-3/4) turns the first rotary_dim dims only. longrope: the
    positions below the pretraining length use the short factors, the others the long ones. transformers
    instead switches a whole forward call to the long factors once any position in it passes that length,
    so beyond it the two can differ (vLLM switches per batch; per position needs no state)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 rotary_dim: int | None = None) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.rotary_dim = rotary_dim or head_dim
        if torch.get_default_device().type == "meta":
            # a shell on the meta device, its table built on the real device by rebuild() (ModelRunner):
            # computing on meta tensors runs torch's Python reference ops, which import torch._dynamo (and
            # triton where installed), about half a second of every engine and stage start-up
            self.register_buffer("cos_sin", torch.empty(self.max_positions, self.rotary_dim), persistent=False)
            return
        self.register_buffer("cos_sin", self._table(), persistent=False)

    def _table(self, device: torch.device | str | None = None) -> torch.Tensor:
        t = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = t[:, None] * rope_inv_freq(self.rotary_dim, self.theta, self.scaling)[None, :]
        if self.scaling is not None and self.scaling.get("rope_type") == "longrope":
            orig = self.scaling["original_max_position_embeddings"]
            long = t[orig:, None] * rope_inv_freq(self.rotary_dim, self.theta, self.scaling, long=True)[None, :]
            freqs[orig:] = long
        a = rope_attention_factor(self.scaling)
        cos, sin = (freqs.cos(), freqs.sin()) if a == 1.0 else (freqs.cos() * a, freqs.sin() * a)
        return torch.cat((cos, sin), dim=-1).to(device)

    def rebuild(self, device: torch.device | str) -> None:
        """The float32 table again, on `device`: after a meta-device construction or a cast of the model."""
        self.cos_sin = self._table(device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.rotary_dim != x.shape[-1]:
            ops.rope_(x[..., :self.rotary_dim], positions, self.cos_sin)
            return x
        return ops.rope_(x, positions, self.cos_sin)
