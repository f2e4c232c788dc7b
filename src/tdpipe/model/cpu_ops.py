"""Fused element-wise ops: the C++ kernel (csrc/ops.cpp) for bf16 CPU tensors, Triton kernels
(model/triton_ops.py) for bf16 CUDA tensors, and the pure-torch equivalents for everything else (float32
everywhere: bit-comparable with transformers).

Unfused, the norms, rotary embedding and SwiGLU cost more than the GEMMs of a prefill batch on a CPU (each
torch op makes its own pass over memory and bf16 reductions are slow), and on a GPU their dozens of tiny
kernels per layer bound a small model's decode step.
"""
from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from tdpipe.model.jit import build

_ops = None
_tried = False
_triton_ops: ModuleType | None = None
_triton_tried = False


def kernel():
    global _ops, _tried
    if not _tried:
        # fast-math lets gcc vectorise the bf16 conversions and exp; float32 keeps torch's exact path
        _ops, _tried = build("tdpipe_ops", "ops.cpp", ["-ffast-math"]), True
    return _ops


def _gpu(x: torch.Tensor) -> ModuleType | None:
    """The Triton ops' module where x is a CUDA tensor they take (None: use torch); imported on first use."""
    global _triton_ops, _triton_tried
    if not x.is_cuda:
        return None
    if not _triton_tried:
        _triton_tried = True
        try:
            from tdpipe.model import triton_ops

            _triton_ops = triton_ops
        except ImportError:  # no triton: torch ops, slower
            _triton_ops = None
    return _triton_ops if _triton_ops is not None and _triton_ops.supports(x) else None


def _rows(x: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """2-D rows (and a residual of x's shape and dtype) that the Triton norm reads by row stride."""
    return x.dim() == 2 and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                                  and residual.stride(-1) == 1))


def _use(x: torch.Tensor) -> bool:
    """bf16 on CPU takes the fused kernel; float32 stays on torch ops, bit-comparable with transformers."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16 and kernel() is not None


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """norm(x + residual); `residual` (when given) is updated in place to x + residual."""
    if _use(x) and x.is_contiguous() and (residual is None or residual.is_contiguous()):
        return kernel().add_rms_norm(x, residual, weight, eps)
    if (gpu := _gpu(x)) is not None and weight.dtype == x.dtype and _rows(x, residual):
        return gpu.add_rms_norm(x, residual, weight, eps)
    if residual is not None:
        residual.add_(x)
        x = residual
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_quant(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                       rotate: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """add_rms_norm's rows as a W8A8 linear's int8 input, (q, scale) = int8_linear.quantize_rows(norm, rotate),
    in one pass (csrc/ops.cpp): bf16 on CPU with the kernel built, else None (the caller normalises and
    quantises apart). `residual` is updated in place as add_rms_norm updates it."""
    if _use(x) and x.is_contiguous() and weight.dtype == x.dtype and (residual is None or residual.is_contiguous()):
        return kernel().add_rms_norm_quant(x, residual, weight, eps, rotate)
    return None


def add_gemma_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """Gemma's norm(x + residual) = normed * (1 + w), the product in float32 and then cast (transformers'
    Gemma3RMSNorm); `residual` (when given) is updated in place to x + residual."""
    if (gpu := _gpu(x)) is not None and _rows(x, residual):
        return gpu.add_rms_norm(x, residual, weight, eps, gemma=True)
    if residual is not None:
        residual.add_(x)
        x = residual
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up over the fused [rows, 2 * inter] gate/up projection (Gemma's GeGLU MLP)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if _use(gate_up) and gate_up.is_contiguous():
        return kernel().silu_and_mul(gate_up)
    if (gpu := _gpu(gate_up)) is not None and gate_up.dim() == 2:
        return gpu.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] in place; cos_sin is [max_pos, D] float32 (cos | sin of the D / 2 frequencies),
    HF's rotate_half convention (both halves of a head turn by the same frequencies)."""
    if _use(x) and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        kernel().rope_(x, positions, cos_sin)
        return x
    if (gpu := _gpu(x)) is not None and x.dim() == 3 and cos_sin.dtype == torch.float32:
        return gpu.rope_(x, positions, cos_sin)
    d = x.shape[-1]
    half = d // 2
    cs = cos_sin[positions].to(x.dtype)
    cos, sin = cs[:, None, :half].repeat(1, 1, 2), cs[:, None, half:].repeat(1, 1, 2)
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    x.copy_(x * cos + rotated * sin)
    return x


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (first index on ties), for greedy-only batches."""
    if _use(logits) and logits.dim() == 2 and logits.is_contiguous():
        return kernel().argmax_rows(logits)
    return logits.argmax(-1)
