"""Activations already quantised for the W8A8 linear that reads them: what a norm hands its linear when the
two are fused (int8_linear.norm_into_linears), so that the normalised rows are never written in bf16."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantizedRows:
    """q int8 [M, K] and its per-row scales (int8_linear.quantize_rows' pair), and the dtype of the rows they
    stand for: the dtype the linear's output takes."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device


__all__ = ["QuantizedRows"]
