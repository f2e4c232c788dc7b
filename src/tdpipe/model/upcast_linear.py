"""bf16 linears on a CPU without bf16 instructions: bf16 weights in memory, float32 arithmetic.

Without `avx512_bf16` / `amx_bf16` (AVX2-only CPUs such as AMD Zen 1-3) oneDNN has no bf16 GEMM and torch's
bf16 `F.linear` falls back to its own emulated kernel: on an AVX2 EPYC it ran SmolLM2's shapes 5-10x slower
than float32 (a 1536 x 576 weight at 256 rows: 78 ms against 8-11 ms), so a `--dtype bfloat16` run, chosen for
its smaller weights and KV cache, paid for it in every step. An `UpcastLinear` keeps the bf16 weight and
widens it to float32 a slice of rows at a time into a small scratch buffer that stays in cache, then runs the
float32 GEMM on that slice. A bf16 x bf16 product is exact in float32, so this is what a bf16 instruction with
float32 accumulation computes (vdpbf16ps): the same numbers up to the order of the sums, one rounding to bf16
at the end. Widening the whole weight per call instead would allocate a float32 copy of it each time (113 MB
for SmolLM2's lm_head, where the page faults alone cost more than the GEMM).
"""
from __future__ import annotations

import threading

import torch
from torch import nn

# float32 bytes of one slice of weight rows: a few hundred KB to a few MB keeps it in L2 / L3 between the
# widening and the GEMM that reads it
SLICE_BYTES = 2 << 20

_scratch = threading.local()


def _buffer(numel: int) -> torch.Tensor:
    """This thread's float32 scratch, grown to `numel` elements when needed. A normal tensor even when first
    asked for under inference_mode, so that a later call outside it may still write into it."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):
            buf = _scratch.buf = torch.empty(numel, dtype=torch.float32)
    return buf


def slice_rows(width: int, rows: int) -> int:
    """Rows of a `width`-wide weight widened at a time: SLICE_BYTES of float32, at least one, at most all."""
    return max(1, min(rows, SLICE_BYTES // (4 * width)))


def widened_mm_nt(w: torch.Tensor, x32: torch.Tensor, rows: int) -> torch.Tensor:
    """W x^T in float32 for a low-precision weight W [N, K] and x32 [M, K]: W's rows widened `rows` at a time.
    Returns [N, M] (each slice's GEMM writes its own rows of the result, in place)."""
    n, k = w.shape
    y_t = torch.empty(n, x32.shape[0], dtype=torch.float32)
    buf = _buffer(rows * k)
    for i in range(0, n, rows):
        r = min(rows, n - i)
        wide = buf[:r * k].view(r, k)
        wide.copy_(w[i:i + r])
        torch.mm(wide, x32.T, out=y_t[i:i + r])
    return y_t


def widened_mm(x32: torch.Tensor, w_t: torch.Tensor, rows: int) -> torch.Tensor:
    """x W^T in float32 for x32 [M, K] and a low-precision W^T [K, N] (int8 W8A8 weights): W^T's rows widened
    `rows` at a time, the partial products summed in place. Returns [M, N]."""
    k, n = w_t.shape
    y = torch.zeros(x32.shape[0], n, dtype=torch.float32)
    buf = _buffer(rows * n)
    for i in range(0, k, rows):
        r = min(rows, k - i)
        wide = buf[:r * n].view(r, n)
        wide.copy_(w_t[i:i + r])
        y.addmm_(x32[:, i:i + r], wide)
    return y


class UpcastLinear(nn.Module):
    """y = x W^T (+ b), W kept in bf16 and widened to float32 one slice of rows at a time."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # shared, not copied: a tied lm_head keeps pointing at the embedding
        self.bias = linear.bias
        self.rows = slice_rows(self.in_features, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, n = x.shape[:-1], self.out_features
        y_t = widened_mm_nt(self.weight.detach(), x.reshape(-1, self.in_features).float(), self.rows)
        if self.bias is not None:
            y_t += self.bias.detach().float()[:, None]
        y = torch.empty(y_t.shape[1], n, dtype=x.dtype)
        y.copy_(y_t.T)
        return y.view(*lead, n)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"rows_per_slice={self.rows}")


__all__ = ["SLICE_BYTES", "UpcastLinear", "slice_rows", "widened_mm", "widened_mm_nt"]
