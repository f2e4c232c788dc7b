"""How a model's linear layers run (`--quantization`): one place that turns a loaded model's nn.Linear
layers into what executes them, for the stages and for the step-cost profile alike.

  none   bf16 weights prepacked for oneDNN on CPU (model/packed_linear.py); float32 and CUDA as loaded
  w8a8   int8 weights per output channel and int8 activations per token (model/int8_linear.py), on CPU;
         the lm_head stays bf16 (packed): per token, torch._int_mm's int32 output at its shape is slower
         than the bf16 GEMM, and the fast int8 head (Int8Head, one activation scale per call) measured +2.5%
         perplexity on its own (`tdpipe bench gemm`, `tdpipe bench perplexity`, docs/quantization.md)
"""
from __future__ import annotations

from torch import nn

from tdpipe.config import QUANTIZATIONS
from tdpipe.model.int8_linear import quantize_linears
from tdpipe.model.packed_linear import pack_linears

KEEP_FLOAT = ("lm_head",)  # children left in floating point under w8a8


def check_quantization(method: str, device: str) -> None:
    """A clear error for a method this build or device cannot run."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {method!r}")
    if method == "w8a8" and device != "cpu":
        raise ValueError(f"quantization 'w8a8' runs on CPU only (torch._int_mm on oneDNN), not on {device!r}")


def prepare_linears(model: nn.Module, method: str) -> int:
    """Replace the linears for `method` after the weights are loaded and cast; returns how many were
    quantised (0 for none)."""
    n = quantize_linears(model, skip=KEEP_FLOAT) if method == "w8a8" else 0
    pack_linears(model)  # whatever stays bf16 on CPU
    return n


__all__ = ["KEEP_FLOAT", "QUANTIZATIONS", "check_quantization", "prepare_linears"]
