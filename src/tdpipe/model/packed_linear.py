"""Linear layers whose bf16 or float32 weight is packed for oneDNN once, at load, instead of on every call.

torch's bf16 `F.linear` on CPU passes oneDNN the plain [out, in] weight, and the GEMM reorders it into its
blocked layout call after call. A decode step reads every weight once for a few rows, so that extra pass
over the weights is a large share of the step: the 15-layer slice of SmolLM2 at 16 decode rows takes
30 ms plain and 20 ms packed, with bit-identical outputs; 2048-token prefill GEMMs gain 2-5%.

float32 `F.linear` goes to MKL's sgemm instead, which on the AMD EPYC development VM runs SmolLM2's decode
shapes at a quarter to two thirds of oneDNN's packed float32 GEMM (4 rows: 3072 x 576 in 367 against 94 us,
the 49152 x 576 head in 17.9 against 6.1 ms; 2048-row prefill 1.15-1.24x), so float32 is packed too. Its
numbers then differ from sgemm's by float32 rounding (a few 1e-6 at these sizes), as any other GEMM order
would. Where the CPU has no bf16 instructions, oneDNN has no bf16 GEMM at all, and bf16 linears become
`UpcastLinear`s instead (upcast_linear.py). `TDPIPE_PACKED_LINEAR=0` turns all of this off (for A/B runs);
other dtypes and non-CPU devices keep `nn.Linear`.
"""
from __future__ import annotations

import functools
import os

import torch
from torch import nn

from tdpipe.config import cpu_supports_bf16
from tdpipe.model.upcast_linear import UpcastLinear


PACKED_DTYPES = (torch.bfloat16, torch.float32)


def switched_off() -> bool:
    """`TDPIPE_PACKED_LINEAR=0`: torch's own linears everywhere, packed and widened ones alike (A/B runs)."""
    return os.environ.get("TDPIPE_PACKED_LINEAR", "1") == "0"


def upcast_wanted(dtype: torch.dtype, device: torch.device) -> bool:
    """bf16 on a CPU whose GEMMs have no bf16 instructions: widened to float32 (upcast_linear.py)."""
    return dtype == torch.bfloat16 and device.type == "cpu" and not cpu_supports_bf16() and not switched_off()


@functools.cache
def packing_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """The oneDNN ops exist in this torch build, work for `dtype`, and are not switched off by the environment."""
    if switched_off() or dtype not in PACKED_DTYPES:
        return False
    try:
        w = torch.randn(8, 16).to(dtype)
        x = torch.randn(3, 16).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        ref = torch.nn.functional.linear(x, w)
        return bool(torch.equal(y, ref) if dtype == torch.bfloat16 else torch.allclose(y, ref, rtol=1e-5, atol=1e-6))
    except (AttributeError, RuntimeError):
        return False


def packed_dtypes() -> list[str]:
    """The dtypes whose linears run packed (or widened, "-upcast") here: part of every cache key whose timings
    depend on it."""
    out = [str(d).removeprefix("torch.") for d in PACKED_DTYPES if packing_available(d)]
    if upcast_wanted(torch.bfloat16, torch.device("cpu")):
        out.append("bfloat16-upcast")
    return out


class PackedLinear(nn.Module):
    """y = x W^T (+ b) with W held in oneDNN's packed layout. Inference only; the plain weight is dropped."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(module: nn.Module) -> int:
    """Replace every bf16 or float32 CPU nn.Linear under `module` by a PackedLinear (or, for bf16 on a CPU
    without bf16 instructions, an UpcastLinear); returns how many were replaced. A no-op where neither
    applies, so callers need not check."""
    n = 0
    for name, child in list(module.named_children()):
        if (isinstance(child, nn.Linear) and child.weight.device.type == "cpu"
                and packing_available(child.weight.dtype)):
            setattr(module, name, PackedLinear(child))
            n += 1
        elif isinstance(child, nn.Linear) and upcast_wanted(child.weight.dtype, child.weight.device):
            setattr(module, name, UpcastLinear(child))
            n += 1
        else:
            n += pack_linears(child)
    return n


__all__ = ["PACKED_DTYPES", "PackedLinear", "pack_linears", "packed_dtypes", "packing_available", "switched_off",
           "upcast_wanted"]
