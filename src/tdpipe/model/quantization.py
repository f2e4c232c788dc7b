"""How a model's linear layers run (`--quantization`): one place that turns a loaded model's nn.Linear
layers into what executes them, for the stages and for the step-cost profile alike.

  none   bf16 weights prepacked for oneDNN on CPU (model/packed_linear.py); float32 and CUDA as loaded; a
         quantised GGUF dequantised (its bf16 or float32 conversion)
  w8a8   int8 weights per output channel and int8 activations per token (model/int8_linear.py), on CPU,
         both rotated by Hadamard blocks of 64 first (x R (W R)^T = x W^T: outliers spread before rounding),
         a SwiGLU MLP's middle in one pass from gate_up's int32 output to down's int8 input (fuse_swiglu),
         each layer's two RMSNorms straight into qkv's and gate_up's int8 rows (norm_into_linears);
         the lm_head int8 per token and rotated too, but in oneDNN's prepacked int8 GEMM writing bf16
         (Int8Head: torch._int_mm's int32 output at 256 x 49152 outgrows the cache), each row scaled after;
         without VNNI as 8-bit blocks against int8 activations per block of 32 (gguf's block GEMM,
         model/block_linear.py, its AVX2 path), without that float (w8a8_head; `tdpipe bench gemm`,
         `tdpipe bench perplexity`, docs/quantization.md). On a CPU without VNNI the int8 GEMMs run in
         float32 arithmetic (int8_linear.py; a notice says so)
  gguf   a GGUF file's quantised blocks kept packed, 4-bit as 4-bit, against int8 activations per block of
         32 (model/block_linear.py, model/gguf_quantized.py), the tied embedding and lm_head included
  awq    an AWQ checkpoint folder's 4-bit weights kept packed, in the same block GEMM (model/awq.py)
  auto   gguf for a .gguf `--model` with quantised tensors and awq for an AWQ folder, run in bf16 on CPU;
         none otherwise (an AWQ folder's linears then dequantised as they load)
"""
from __future__ import annotations

import functools

from pathlib import Path

from torch import nn

from tdpipe.config import QUANTIZATIONS, cpu_supports_vnni
from tdpipe.model.int8_linear import fuse_swiglu, norm_into_linears, quantize_linears
from tdpipe.model.packed_linear import pack_linears

KEEP_FLOAT = ("lm_head",)  # children not made Int8Linear under w8a8 (the head: w8a8_head)


def check_quantization(method: str, device: str) -> None:
    """A clear error for a method this build or device cannot run."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {method!r}")
    if method in ("w8a8", "gguf", "awq") and device != "cpu":
        raise ValueError(f"quantization {method!r} runs on CPU only (int8 GEMMs on AVX-512), not on {device!r}")


def gguf_source(model: str | None) -> str:
    """The GGUF file behind `--model` ('' for a folder or random weights): the bundled model's too."""
    if model is None:
        from tdpipe.model.bundled import bundled_gguf_path

        try:
            return bundled_gguf_path()
        except FileNotFoundError:
            return ""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.is_file() and path.suffix.lower() == ".gguf" else ""


def resolve_quantization(method: str, model: str | None, device: str, bf16: bool) -> tuple[str, str]:
    """(method, gguf file) that the stages run: `auto` decided here, `gguf` checked to have a file and `awq`
    an AWQ folder."""
    from tdpipe.model.awq import awq_spec
    from tdpipe.model.gguf_quantized import has_quantized_linears

    if method == "auto":  # the bundled model (model None) stays its bf16 conversion unless asked
        if device == "cpu" and bf16 and awq_spec(model):
            return "awq", ""
        src = gguf_source(model) if model is not None else ""
        keep = bool(src) and device == "cpu" and bf16 and has_quantized_linears(src)
        return ("gguf", src) if keep else ("none", "")
    if method == "awq" and not awq_spec(model):
        raise ValueError(f"quantization 'awq' needs an AWQ checkpoint folder (config.json's quantization_config "
                         f"with quant_method 'awq'), got {model or 'the bundled model'!r}")
    if method == "gguf":
        src = gguf_source(model)
        if not src or not has_quantized_linears(src):
            raise ValueError(f"quantization 'gguf' needs a GGUF --model with quantised linear weights, got "
                             f"{model or 'the bundled model, whose GGUF is missing'!r}")
        return "gguf", src
    return method, ""


def prepare_linears(model: nn.Module, method: str, gguf_file: str = "", folder: str = "") -> int:
    """Replace the linears for `method` after the weights are loaded and cast; returns how many were
    quantised (0 for none). `gguf` without a file, `awq` without an AWQ folder (the step-cost profile's
    random layer; new float weights from update_weights): 4-bit blocks of the float weights, the same GEMMs."""
    if method == "w8a8":
        w8a8_notice()
        n = quantize_linears(model, skip=KEEP_FLOAT)
        fuse_swiglu(model)
        norm_into_linears(model)
        w8a8_head(model)
    elif method == "gguf":
        from tdpipe.model.gguf_quantized import keep_gguf_blocks, quantize_blocks_from_float

        n = keep_gguf_blocks(model, gguf_file) if gguf_file else quantize_blocks_from_float(model)
    elif method == "awq":
        from tdpipe.model.awq import awq_spec, keep_awq_blocks
        from tdpipe.model.gguf_quantized import quantize_blocks_from_float

        n = keep_awq_blocks(model, folder) if awq_spec(folder) else quantize_blocks_from_float(model)
    else:
        n = 0
    pack_linears(model)  # whatever stays bf16 or float32 on CPU
    return n


@functools.cache
def w8a8_notice() -> str:
    """Said once on stderr where W8A8 will be slower than float: a CPU without VNNI, where its int8 GEMMs run
    in float32 arithmetic (docs/cpus.md). Returns the line ('' where nothing was said)."""
    from tdpipe.model.cache import notice

    if cpu_supports_vnni():
        return ""
    line = ("W8A8 on a CPU without VNNI (no avx512_vnni / avx_vnni): no int8 dot products here, so the int8 "
            "GEMMs run in float32 arithmetic (int8 weights in memory, speed below float32); --quantization none "
            "is the fast path on this CPU")
    notice(line)
    return line


def w8a8_head(model: nn.Module) -> str:
    """W8A8's lm_head (module docstring): Int8Head (per-token activations, rotated, oneDNN's int8 GEMM)
    where the CPU has VNNI and oneDNN computes right; else 8-bit blocks where the C++ block GEMM runs fast
    (its AVX2 path; K a multiple of the 32-wide block); else the float head, where the portable block loop
    would be the slowest layer by far. Returns which: "int8", "blocks" or "float"."""
    from tdpipe.model.block_linear import BlockLinear, vector_block_gemm
    from tdpipe.model.gguf_blocks import BLOCK
    from tdpipe.model.int8_linear import Int8Head, onednn_head_dtype

    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear) or head.weight.device.type != "cpu":
        return "float"
    if cpu_supports_vnni() and onednn_head_dtype(head.weight.dtype) is not None:
        model.lm_head = Int8Head(head)
        return "int8"
    if head.in_features % BLOCK or not vector_block_gemm():
        return "float"
    model.lm_head = BlockLinear.from_float(head, 8)
    return "blocks"


__all__ = ["KEEP_FLOAT", "QUANTIZATIONS", "check_quantization", "gguf_source", "prepare_linears",
           "resolve_quantization", "w8a8_head", "w8a8_notice"]
