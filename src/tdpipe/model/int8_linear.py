"""W8A8 linear layers for CPU (`--quantization w8a8`): int8 weights per output channel, int8 activations per
token, int32 accumulation, scales applied in float32 after the GEMM.

Why: past a decode batch of about 8 a CPU step is compute-bound, and AVX-512 VNNI (VPDPBUSD) does twice the
multiply-adds per instruction in int8 that AVX512_BF16 does in bf16. The GEMM is torch._int_mm (oneDNN's
s8 x s8 -> s32, which uses VNNI where the CPU has it); the activation quantisation before it and the scaling
after it are one pass each in csrc/int8.cpp (pure torch where that kernel is unavailable, same numbers).

    W ~ diag(s_w) Q_w   (s_w[n] = max_k |W[n, k]| / 127, per output channel, computed once at load)
    x ~ diag(s_x) Q_x   (s_x[m] = max_k |x[m, k]| / 127, per token, at every call)
    y = (Q_x Q_w^T) * s_x[:, None] * s_w[None, :] (+ b)

Both sides are rotated first (QuaRot's idea, Ashkboos et al., 2024, with blocks instead of whole rows):
x R (W R)^T = x W^T for R = diag(H_64 / 8, ...), H_64 Sylvester's Hadamard matrix, orthonormal. W R is
quantised once at load; x R costs a fast Walsh-Hadamard transform per 64 values inside the quantise pass
(csrc/int8.cpp rotate64). Why: a per-token int8 scale is set by the row's largest |x|, and these models'
activations have a few channels hundreds of times larger than the rest (up to 10^5 in the bundled model);
rotated, each such value is spread over its 64-wide block, and the other blocks' values keep their
resolution. On the bundled model's perplexity: +2.0% -> +0.15%; on Gemma 3 270M: +3.6% -> +0.65%
(docs/quantization.md). Linears whose input width is not a multiple of 64 are not rotated.

On a CPU without VNNI torch._int_mm has no fast kernel (1-3 GOP/s on an AVX2 EPYC, against ~100 GFLOP/s for
float32), so there the same integer products are summed in float32 arithmetic instead: the int8 weight widened
a slice at a time (upcast_linear.widened_mm), exact while a sum stays below 2^24 (K x 127^2 < 2^24 for
K <= 1040, and activations far from all-max sums go much further), within float32 rounding past that.

Tensor parallelism needs nothing more: each rank quantises its own shard, and a row-parallel shard's partial
sums are dequantised before the all-reduce.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from tdpipe.config import cpu_supports_vnni
from tdpipe.model import cpu_ops
from tdpipe.model.layers import RMSNorm
from tdpipe.model.quantized_rows import QuantizedRows
from tdpipe.model.upcast_linear import slice_rows, widened_mm

QMAX = 127  # symmetric: -127..127, so that -q is always representable
ROTATE = 64  # the rotation's block (module docstring); 0: no rotation (the perplexity ablation's switch)
HEAD_ROWS = 256  # Int8Head's rows per oneDNN call: a decode batch in one, prompt logprobs' thousands in slices


def rotates(in_features: int) -> bool:
    """Whether a W8A8 linear of this input width rotates its weight and inputs (module docstring)."""
    return ROTATE == 64 and in_features % 64 == 0


def rotate64(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 times diag(H_64 / 8, ...): csrc/int8.cpp rotate64's butterflies in the same order,
    so the same bits."""
    m, k = x.shape
    for h in (1, 2, 4, 8, 16, 32):
        v = x.reshape(m, k // (2 * h), 2, h)
        a, b = v[:, :, 0], v[:, :, 1]
        x = torch.stack((a + b, a - b), dim=2).reshape(m, k)
    return x * 0.125


def quantize_rows(x: torch.Tensor, rotate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [M, K], scale float32 [M]): per-row symmetric quantisation, round half to even; `rotate`: of
    x R (rotate64; K a multiple of 64)."""
    k = cpu_ops.kernel()  # csrc/int8.cpp is built into it
    if k is not None and x.device.type == "cpu" and x.is_contiguous() and x.dtype in (torch.bfloat16, torch.float32):
        return k.quantize_rows(x, rotate)
    xf = rotate64(x.float()) if rotate else x.float()
    amax = xf.abs().amax(dim=1)
    inv = torch.where(amax > 0, amax.new_full(amax.shape, QMAX) / amax, 0.0)  # not QMAX / amax: 1/a * 127 in torch
    q = torch.round(xf * inv[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, amax / QMAX


def dequant_rows(acc: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> torch.Tensor:
    """acc * sx[:, None] * sw[None, :] (+ bias) in float32, returned in `dtype`."""
    k = cpu_ops.kernel()
    if k is not None and acc.device.type == "cpu" and dtype in (torch.bfloat16, torch.float32):
        return k.dequant_rows(acc.contiguous(), sx, sw, bias, dtype)
    y = acc.float() * sx[:, None] * sw[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype)


def scale_rows_(y: torch.Tensor, s: torch.Tensor) -> None:
    """In place y[m, :] *= s[m] (float32 math, stored in y's dtype): csrc/int8.cpp where built, the same bits."""
    k = cpu_ops.kernel()
    if k is not None and y.device.type == "cpu" and y.is_contiguous() and y.dtype in (torch.bfloat16, torch.float32):
        k.scale_rows_(y, s)
    else:
        y.mul_(s[:, None])


def quantize_weight(w: torch.Tensor, rotate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q_w^T int8 [K, N] contiguous, s_w float32 [N]) of a [N, K] weight: per output channel; `rotate`: of
    W R, its rows rotated as the activations' are."""
    q, s = quantize_rows(w.detach().float().contiguous(), rotate)
    return q.t().contiguous(), s


class Int8Linear(nn.Module):
    """y = x W^T (+ b) as W8A8 (module docstring). Inference only; the float weight is dropped."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.rotate = rotates(self.in_features)  # x R (W R)^T (module docstring)
        qt, s = quantize_weight(linear.weight, self.rotate)
        self.register_buffer("qweight_t", qt)  # [K, N]: torch._int_mm's right operand, row-major
        self.register_buffer("weight_scale", s)
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()
        # rows of W^T widened at a time where the integer GEMM runs in float32 (module docstring), 0: torch._int_mm
        slow_int_mm = qt.device.type == "cpu" and not cpu_supports_vnni()
        self.float_rows = slice_rows(self.out_features, self.in_features) if slow_int_mm else 0

    def int_mm(self, q: torch.Tensor) -> torch.Tensor:
        """Q_x Q_w^T as int32 [M, N]."""
        if not self.float_rows:
            return torch._int_mm(q, self.qweight_t)
        return widened_mm(q.float(), self.qweight_t, self.float_rows).to(torch.int32)

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        shape = x.shape
        q, sx = quantized(x, self.in_features, self.rotate)
        acc = self.int_mm(q)
        y = dequant_rows(acc, sx, self.weight_scale, self.bias, x.dtype)
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        gemm = f"float32 arithmetic, {self.float_rows} rows a slice" if self.float_rows else "torch._int_mm"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"w8a8 ({gemm}{', inputs rotated' if self.rotate else ''})")


def quantized(x: torch.Tensor | QuantizedRows, width: int, rotate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) of a linear's input rows: quantised here, or already by the norm before it."""
    if isinstance(x, QuantizedRows):
        return x.q, x.scale
    return quantize_rows(x.reshape(-1, width).contiguous(), rotate)


def swiglu_w8a8(gate_up: Int8Linear, down: Int8Linear, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
    """down(silu(gate) * up) of a W8A8 SwiGLU MLP (before TP's all-reduce), with the middle in one pass
    (csrc/ops.cpp swiglu_quant): gate_up's int32 output goes straight to down's int8 input, where the
    unfused layers dequantise it to bf16, apply SwiGLU and quantise again, three passes over memory. The
    same roundings, so the same numbers; bf16 activations on CPU with the kernel built, else unfused."""
    k = cpu_ops.kernel()
    if k is None or x.dtype != torch.bfloat16 or x.device.type != "cpu" or gate_up.bias is not None:
        return down(cpu_ops.silu_and_mul(gate_up(x)))
    shape = x.shape
    q, sx = quantized(x, gate_up.in_features, gate_up.rotate)
    hq, sh = k.swiglu_quant(gate_up.int_mm(q), sx, gate_up.weight_scale, down.rotate)
    y = dequant_rows(down.int_mm(hq), sh, down.weight_scale, down.bias, x.dtype)
    return y.view(*shape[:-1], down.out_features)


@functools.cache
def onednn_qlinear_available(out_dtype: torch.dtype = torch.bfloat16) -> bool:
    """oneDNN's prepacked int8 linear exists in this torch build and computes what it should when it writes
    `out_dtype`. Probed on a shape its blocked kernels take, not a toy one: on an AVX2 CPU without VNNI
    (AMD EPYC, torch 2.13) its float32 output is wrong by ~17% of the norm while its bf16 output is right."""
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randint(-127, 128, (48, 64), generator=gen, dtype=torch.int8)
        x = torch.randint(0, 256, (8, 64), generator=gen, dtype=torch.uint8)  # zero point 128
        ref = ((x.long() - 128) @ w.long().t()).float()  # |sums| < 2^21: exact in float32
        y = torch.ops.onednn.qlinear_pointwise(x, 1.0, 128, torch.ops.onednn.qlinear_prepack(w, None),
                                               torch.ones(48), torch.zeros(48, dtype=torch.int64), None, 1.0, 0,
                                               out_dtype, "none", [], "")
        return torch.equal(y, ref.to(out_dtype))
    except (AttributeError, RuntimeError):
        return False


def onednn_head_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The output dtype Int8Head asks oneDNN for when it runs in `dtype`: `dtype` where that is right, else bf16
    (cast back), else None (unavailable)."""
    for out in (dtype, torch.bfloat16):
        if onednn_qlinear_available(out):
            return out
    return None


class Int8Head(nn.Module):
    """An lm_head as W8A8 in oneDNN's prepacked int8 linear (brgemm, VNNI), which applies the weight scales
    and writes bf16 itself, where torch._int_mm's int32 output at 256 x 49152 is larger than the cache and
    the per-token path with it slower than bf16.

    per_row (the engine's): the activations quantised per token, rotated like Int8Linear's, oneDNN run with
    activation scale 1 and each output row then multiplied by its s_x: the roundings of Int8Linear, one bf16
    rounding more. Not per_row: one activation scale per call (the batch's max |x| / 127), as oneDNN takes
    it: +2.5% perplexity on SmolLM2 on its own, unrotated (rows whose ranges differ after the norm weight);
    kept for scripts/quant/ppl_ablation.py's comparison. `tdpipe bench gemm` times the engine's (w8a8-head)."""

    def __init__(self, linear: nn.Linear, per_row: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.per_row = per_row
        self.rotate = per_row and rotates(self.in_features)
        q, s = quantize_rows(linear.weight.detach().float().contiguous(), self.rotate)
        self.packed = torch.ops.onednn.qlinear_prepack(q, None)
        self.register_buffer("weight_scale", s)
        self.register_buffer("weight_zero", torch.zeros(self.out_features, dtype=torch.int64))
        self.bias = None if linear.bias is None else linear.bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = onednn_head_dtype(x.dtype)
        if out is None:
            raise RuntimeError("Int8Head: oneDNN's int8 linear is unavailable or computes wrongly in this torch build")
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).contiguous()
        if self.per_row:
            q, sx = quantize_rows(x2, self.rotate)
            qx, scale = q.view(torch.uint8).bitwise_xor_(0x80), 1.0  # q + 128 as uint8: oneDNN's zero point 128
        else:
            xf = x2.float()
            amax = float(xf.abs().max()) if xf.numel() else 0.0
            scale = amax / QMAX if amax > 0 else 1.0
            qx = torch.round(xf * (1.0 / scale)).clamp_(-QMAX, QMAX).add_(128).to(torch.uint8)
        m = qx.shape[0]
        if m <= HEAD_ROWS:
            y = self._gemm(qx, scale, out, sx if self.per_row else None)
        else:  # oneDNN's scratch is ~4x its output: 20 GB at once for 8,192 rows of Gemma 3's 262k vocabulary
            y = torch.empty(m, self.out_features, dtype=out)
            for i in range(0, m, HEAD_ROWS):
                y[i:i + HEAD_ROWS] = self._gemm(qx[i:i + HEAD_ROWS], scale, out,
                                                sx[i:i + HEAD_ROWS] if self.per_row else None)
        return y.to(x.dtype).view(*shape[:-1], self.out_features)

    def _gemm(self, qx: torch.Tensor, scale: float, out: torch.dtype, sx: torch.Tensor | None) -> torch.Tensor:
        """oneDNN's int8 linear on rows of uint8 activations (zero point 128), then each row times sx."""
        y = torch.ops.onednn.qlinear_pointwise(qx, scale, 128, self.packed, self.weight_scale, self.weight_zero,
                                               None, 1.0, 0, out, "none", [], "")
        if sx is not None:
            scale_rows_(y, sx)
        if self.bias is not None:
            y.add_(self.bias)
        return y

    def extra_repr(self) -> str:
        acts = ("per-token activations" + (", inputs rotated" if self.rotate else "")) if self.per_row else \
            "per-tensor activations"
        return f"in_features={self.in_features}, out_features={self.out_features}, w8a8 ({acts})"


def fuse_swiglu(model: nn.Module) -> int:
    """Give every SwiGLU MLP whose gate_up and down are Int8Linear the one-pass middle (swiglu_w8a8), as its
    `fused` forward; returns how many."""
    n = 0
    for m in model.modules():
        if (getattr(m, "act", None) is cpu_ops.silu_and_mul and isinstance(getattr(m, "gate_up_proj", None), Int8Linear)
                and isinstance(getattr(m, "down_proj", None), Int8Linear)):
            m.fused = functools.partial(swiglu_w8a8, m.gate_up_proj, m.down_proj)
            n += 1
    return n


def norm_into_linears(model: nn.Module) -> int:
    """Have each pre-norm layer's two RMSNorms hand their W8A8 linears int8 rows (QuantizedRows, one pass:
    csrc/ops.cpp add_rms_norm_quant) where a norm's output goes only to such linears: input_layernorm to
    qkv_proj, post_attention_layernorm to the MLP's gate_up_proj (not in Gemma's sandwich layers, whose
    post-attention norm reads the attention's output). The same bits as normalising, then quantising in the
    linear. Returns how many norms quantise now."""
    n = 0
    for m in model.modules():
        attn, mlp = getattr(m, "self_attn", None), getattr(m, "mlp", None)
        if attn is None or mlp is None or hasattr(m, "pre_feedforward_layernorm"):
            continue
        for norm, linear in ((getattr(m, "input_layernorm", None), getattr(attn, "qkv_proj", None)),
                             (getattr(m, "post_attention_layernorm", None), getattr(mlp, "gate_up_proj", None))):
            if type(norm) is RMSNorm and isinstance(linear, Int8Linear) and linear.in_features == norm.weight.numel():
                norm.quantize_rotate = linear.rotate
                n += 1
    return n


def quantize_linears(module: nn.Module, skip: tuple[str, ...] = ()) -> int:
    """Replace every nn.Linear under `module` (except children named in `skip`) by an Int8Linear; returns how
    many were replaced."""
    n = 0
    for name, child in list(module.named_children()):
        if name in skip:
            continue
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8Linear(child))
            n += 1
        else:
            n += quantize_linears(child, skip)
    return n


__all__ = ["Int8Head", "Int8Linear", "QMAX", "ROTATE", "dequant_rows", "fuse_swiglu", "norm_into_linears",
           "onednn_head_dtype", "onednn_qlinear_available", "quantize_linears", "quantize_rows", "quantize_weight",
           "quantized", "rotate64", "rotates", "scale_rows_", "swiglu_w8a8"]
