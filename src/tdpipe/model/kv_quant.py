"""The int8 KV cache's row format (--kv-cache-dtype int8): what a cache row holds and how it is written and read.

Decode attention reads every cached key and value of every sequence at each step and is bound by memory
bandwidth on a CPU (model/paged_attention.py); one byte per element instead of two halves what it reads, and a
KV budget holds nearly twice the tokens. Each token's key (and value) in each kv head is quantised on its own,
symmetric, with a float32 scale: s = max|x| / 127, q = round(x / s) in [-127, 127], so the error of an element
is at most s / 2 of its row's largest (per-token-and-head scales, as LMDeploy's and TensorRT-LLM's int8 KV
caches; vLLM's fp8 caches use one scale per tensor). The scale is stored at the end of the row, so a cache
stays one tensor per layer ([blocks, kv heads, block_size, width] int8, width = head_dim padded to 4 bytes + 4)
and everything that moves blocks (copy-on-write, disaggregation's KV transfer) moves the scales with them.

The attention kernel (csrc/paged_attention.cpp) folds a key's scale into its converted row and a value's into
its softmax weight; `quantize_rows` and `dequantize_rows` are the reference it is tested against (store_kv's
C++ loop writes the same bytes).
"""
from __future__ import annotations

import torch

from tdpipe.config import KV_SCALE_BYTES, int8_kv_row_width

INT8 = "int8"


def cache_layout(kv_cache_dtype: str, dtype: torch.dtype, head_dim: int) -> tuple[torch.dtype, int]:
    """(storage dtype, last dimension) of a cache for `--kv-cache-dtype`: auto keeps the run's dtype and head_dim."""
    if kv_cache_dtype == INT8:
        return torch.int8, int8_kv_row_width(head_dim)
    return dtype, head_dim


def check_kv_cache_dtype(kv_cache_dtype: str, device: str) -> str:
    """The cache dtype if `device` ('cpu', 'cuda') can run it; int8 is read by the CPU kernel only."""
    if kv_cache_dtype == INT8 and device != "cpu":
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} runs on cpu only so far (device is {device}); the "
                         "Triton kernels read bf16 / fp16 / fp32 caches: use kv_cache_dtype 'auto'")
    return kv_cache_dtype


def is_int8(cache: torch.Tensor) -> bool:
    """Does this cache hold int8 rows with their scales?"""
    return cache.dtype == torch.int8


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """int8 cache rows [..., width] for float rows x [..., D]: round(x * (127 / max|x|)) and the float32 scale
    max|x| / 127 in the last 4 bytes (an all-zero row: zeros and scale 0)."""
    d = x.shape[-1]
    width = int8_kv_row_width(d)
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # a true division, as the kernel's 127.f / amax (torch's `127.0 / t` is reciprocal(t) * 127, rounded twice)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv).clamp_(-127, 127).to(torch.int8)
    out = torch.zeros((*x.shape[:-1], width), dtype=torch.int8, device=x.device)
    out[..., :d] = q
    out[..., width - KV_SCALE_BYTES:] = (amax / 127.0).view(torch.int8)
    return out


def row_scales(rows: torch.Tensor) -> torch.Tensor:
    """The float32 scales [...] of int8 cache rows [..., width]."""
    return rows[..., rows.shape[-1] - KV_SCALE_BYTES:].contiguous().view(torch.float32).squeeze(-1)


def dequantize_rows(rows: torch.Tensor, head_dim: int | None = None) -> torch.Tensor:
    """float32 rows [..., D] of int8 cache rows [..., width] (D: head_dim, else width - 4)."""
    d = head_dim if head_dim is not None else rows.shape[-1] - KV_SCALE_BYTES
    return rows[..., :d].float() * row_scales(rows).unsqueeze(-1)


__all__ = ["INT8", "cache_layout", "check_kv_cache_dtype", "dequantize_rows", "is_int8", "quantize_rows", "row_scales"]
