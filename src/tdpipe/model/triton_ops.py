"""The element-wise parts of a decoder layer as Triton kernels, for bf16 CUDA tensors: add + RMSNorm
(plain and Gemma's), SiLU x mul, and rotary embedding in place. In plain torch each is a chain of small
kernels (RMSNorm about eight, rotary about ten per tensor); a decode step of a small model on a GPU is bound by
that count (docs/gpu.md, "Where the time goes"), so each becomes one launch here.

Each kernel rounds where the torch reference in model/cpu_ops.py rounds (the residual sum, the normed value
before the weight, silu before the product, cos and sin and each product of the rotation), so outputs match
it to the last bit except where a float32 reduction or exp is ordered or rounded differently (a bf16 ulp at
most). float32 stays on the torch ops, bit-comparable with transformers, as on CPU. CPU tensors run these
through Triton's interpreter (tests/unit/test_triton_ops.py), CUDA tensors compiled (tests/gpu).

GPU status: a first version (rounding by plain casts) ran on an H200 and halved the bundled model's decode
step (docs/gpu.md); this version, with the roundings written as integer arithmetic, has been checked on CPUs
only (bit for bit against torch under the interpreter) and has not run on a GPU yet.
"""
from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import triton.language as tl

from tdpipe.model.triton_jit import interpret_for, kernel_set, launching, pow2


# kernel bodies (wrapped by _kernels; see model/triton_jit.py). Every rounding to bf16 is written out as
# integer arithmetic on the float32 bits (round to nearest, ties to even, as torch rounds): with a plain
# `.to(bf16).to(float32)` between two float ops, rotary differed from torch on an H200 where its products
# cancel, as if the pair had been folded away, and the interpreter truncates instead of rounding. Each
# `u = v.to(uint32, bitcast) ; v = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(float32, bitcast)` below is
# that rounding, inline because these bodies call no other jitted function.
def _add_rms_norm_body(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, n, eps,
                       HAS_RES: tl.constexpr, GEMMA: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: res += x (stored), then norm(res) * w (plain) or norm(res) * (1 + w) (Gemma)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    m = c < n
    xf = tl.load(x_ptr + row * stride_x + c, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        xf += tl.load(res_ptr + row * stride_r + c, mask=m, other=0.0).to(tl.float32)
        u = xf.to(tl.uint32, bitcast=True)
        xf = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        tl.store(res_ptr + row * stride_r + c, xf.to(tl.bfloat16), mask=m)
    y = xf * tl.rsqrt(tl.sum(xf * xf, 0) / n + eps)
    w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
    if GEMMA:
        y = y * (1.0 + w)
    else:
        u = y.to(tl.uint32, bitcast=True)
        y = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True) * w
    u = y.to(tl.uint32, bitcast=True)
    y = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    tl.store(out_ptr + row * stride_o + c, y.to(tl.bfloat16), mask=m)


def _silu_and_mul_body(gu_ptr, out_ptr, stride_g, stride_o, inter, BLOCK: tl.constexpr):
    """Program (row, column block): silu(gate) rounded, times up, rounded."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < inter
    g = tl.load(gu_ptr + row * stride_g + c, mask=m, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_g + inter + c, mask=m, other=0.0).to(tl.float32)
    s = g / (1.0 + tl.exp(-g))
    u = s.to(tl.uint32, bitcast=True)
    s = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True) * up
    u = s.to(tl.uint32, bitcast=True)
    s = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    tl.store(out_ptr + row * stride_o + c, s.to(tl.bfloat16), mask=m)


def _rope_body(x_ptr, pos_ptr, cs_ptr, stride_t, stride_h, stride_cs, heads, half,
               BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per token: every head's first 2 * half dims turned in place (rotate_half convention):
    x1' = r(r(x1 cos) - r(x2 sin)), x2' = r(r(x2 cos) + r(x1 sin)), cos and sin rounded first (r: to bf16)."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, BLOCK_D)[None, :]
    h = tl.arange(0, BLOCK_H)[:, None]
    m = (h < heads) & (j < half)
    u = tl.load(cs_ptr + pos * stride_cs + j, mask=j < half, other=0.0).to(tl.uint32, bitcast=True)
    cos = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    u = tl.load(cs_ptr + pos * stride_cs + half + j, mask=j < half, other=0.0).to(tl.uint32, bitcast=True)
    sin = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    base = x_ptr + t * stride_t + h * stride_h
    x1 = tl.load(base + j, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + half + j, mask=m, other=0.0).to(tl.float32)
    u = (x1 * cos).to(tl.uint32, bitcast=True)
    a = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    u = (x2 * sin).to(tl.uint32, bitcast=True)
    b = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    u = (a - b).to(tl.uint32, bitcast=True)
    o1 = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    u = (x2 * cos).to(tl.uint32, bitcast=True)
    a = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    u = (x1 * sin).to(tl.uint32, bitcast=True)
    b = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    u = (a + b).to(tl.uint32, bitcast=True)
    o2 = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    tl.store(base + j, o1.to(tl.bfloat16), mask=m)
    tl.store(base + half + j, o2.to(tl.bfloat16), mask=m)


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    return kernel_set(interpret, add_rms_norm=_add_rms_norm_body, silu_and_mul=_silu_and_mul_body,
                      rope=_rope_body)


def _warps(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8


def supports(x: torch.Tensor) -> bool:
    """Do these kernels take x? bf16 with a contiguous last dim (float32 keeps torch's exact ops; float16
    too, for now: the kernels round to bf16 only)."""
    return x.dtype == torch.bfloat16 and x.stride(-1) == 1


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 gemma: bool = False) -> torch.Tensor:
    """norm(x + residual) over the last dim of 2-D rows; `residual` (when given) becomes x + residual in place.
    Plain: weight (bf16) * normed-in-bf16; Gemma: (normed * (1 + w)) in bf16, w of any float dtype."""
    n = x.shape[-1]
    rows = x.shape[0]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    res = residual if residual is not None else x
    kern = _kernels(interpret_for(x))
    block = pow2(n)
    with launching(kern):
        kern.add_rms_norm[(rows,)](x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), n, eps,
                                   HAS_RES=residual is not None, GEMMA=gemma, BLOCK=block, num_warps=_warps(block))
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up over 2-D [rows, 2 * inter] rows (gate first)."""
    rows, width = gate_up.shape
    inter = width // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    block = min(pow2(inter), 1024)
    kern = _kernels(interpret_for(gate_up))
    with launching(kern):
        kern.silu_and_mul[(rows, -(-inter // block))](gate_up, out, gate_up.stride(0), out.stride(0), inter,
                                                        BLOCK=block, num_warps=_warps(block))
    return out


def rope_(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] (a strided view is fine: last dim contiguous) in place by positions [T]; cos_sin is
    [max_pos, D] float32, cos | sin of the D / 2 frequencies."""
    t, heads, d = x.shape
    if t == 0:
        return x
    half = d // 2
    pos = positions if positions.device == x.device else positions.to(x.device)
    kern = _kernels(interpret_for(x))
    with launching(kern):
        kern.rope[(t,)](x, pos, cos_sin, x.stride(0), x.stride(1), cos_sin.stride(0), heads, half,
                        BLOCK_H=pow2(heads), BLOCK_D=pow2(half), num_warps=_warps(pow2(heads) * pow2(half)))
    return x
