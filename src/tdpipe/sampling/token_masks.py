"""A grammar's token bitmask applied to logits (sampling/grammar.py fills it): xgrammar's layout, bit j % 32
of int32 word j / 32 set when token j is allowed. The sampler takes a greedy row's argmax over its allowed
tokens in place, and masks its float32 copy of the other constrained rows."""
from __future__ import annotations

import torch

from tdpipe.model import cpu_ops


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, the tokens `bitmask` [R, ceil(V / 32)] forbids in `logits` (float32, [R, V]):
    tdpipe's kernel (csrc/bitmask.cpp: 16 lanes per instruction, rows over the threads), else xgrammar's."""
    k = cpu_ops.kernel() if logits.device.type == "cpu" else None
    if k is not None and logits.dtype == torch.float32 and logits.is_contiguous():
        k.apply_bitmask_(logits, bitmask.contiguous())
        return
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=logits.shape[-1])


def masked_argmax(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> list[int]:
    """Per row in `rows` (of `logits` [R, V] and `bitmask` [R, ceil(V / 32)]): the first index of its largest
    allowed logit, reading only the allowed tokens and copying nothing (-1 where nothing is allowed)."""
    k = cpu_ops.kernel() if logits.device.type == "cpu" else None
    if k is not None and logits.dtype in (torch.float32, torch.bfloat16) and logits.is_contiguous():
        return k.masked_argmax_rows(logits, bitmask.contiguous(), torch.tensor(rows, dtype=torch.int64)).tolist()
    x = logits[rows].to(torch.float32)
    apply_bitmask(x, bitmask[rows])
    out = x.argmax(-1)
    return torch.where(torch.isneginf(x.amax(-1)), -1, out).tolist()


__all__ = ["apply_bitmask", "masked_argmax"]
