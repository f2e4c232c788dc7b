"""GGUF quantised tensors read as integer blocks, without a float round trip: (q, s, m) with

    w[n, k] = s[n, k // 32] * q[n, k] + m[n, k // 32]     q unsigned bytes, s and m float32

the form the block-quantised GEMM multiplies (csrc/qgemm.cpp, model/block_linear.py). Exact for the types
llama.cpp's Q4_K_M and Q4_0 / Q4_1 / Q8_0 files are made of: s * q + m in float32 is the value gguf-py's
dequantise computes, bit for bit (tests/unit/test_block_linear.py):

  Q4_0   q 0..15, s = d, m = -8 d                Q4_1   q 0..15, s = d, m = m
  Q4_K   q 0..15, s = d * sc_j, m = -dmin * m_j  (256-weight super-blocks, 6-bit sub-block scale and min)
  Q5_0   q 0..31, s = d, m = -16 d               Q8_0   q + 128 in 0..255, s = d, m = -128 d

Any other type (Q6_K, Q5_K, F16...) is dequantised by gguf-py and re-quantised to 8 bits per block of 32
with its own min and max: the one float round trip, and about 1/255 of a block's range.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

BLOCK = 32
EXACT_4BIT = (Q.Q4_0, Q.Q4_1, Q.Q4_K)
EXACT_8BIT = (Q.Q8_0, Q.Q5_0)
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16, Q.F64)


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: the low nibbles are weights 0..15, the high 16..31 (Q4_0, Q4_1, Q5_0)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def blocks_of(tensor_type: Any, raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray,
                                                                                  np.ndarray, int]:
    """(q uint8 [rows, cols], s float32 [rows, cols / 32], m float32 [rows, cols / 32], bits 4 or 8) of one
    GGUF tensor's data (uint8 [rows, bytes per row], as gguf-py's reader gives it)."""
    if cols % BLOCK:
        raise ValueError(f"a quantised linear needs in_features divisible by {BLOCK}, got {cols}")
    nb = cols // BLOCK
    raw = np.asarray(raw).reshape(rows, -1)
    if tensor_type == Q.Q8_0:
        b = raw.reshape(rows, nb, 34)
        d = _f16(b[..., 0:2])
        q = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return q.reshape(rows, cols), d, -128.0 * d, 8
    if tensor_type == Q.Q4_0:
        b = raw.reshape(rows, nb, 18)
        d = _f16(b[..., 0:2])
        return _nibbles(b[..., 2:]).reshape(rows, cols), d, -8.0 * d, 4
    if tensor_type == Q.Q4_1:
        b = raw.reshape(rows, nb, 20)
        return _nibbles(b[..., 4:]).reshape(rows, cols), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 4
    if tensor_type == Q.Q5_0:
        b = raw.reshape(rows, nb, 22)
        d = _f16(b[..., 0:2])
        qh = np.ascontiguousarray(b[..., 2:6]).view(np.uint32)  # [rows, nb, 1], little-endian
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # bit j: weight j's fifth bit
        q = _nibbles(b[..., 6:]) | (high << 4)
        return q.reshape(rows, cols), d, -16.0 * d, 8
    if tensor_type == Q.Q4_K:
        if cols % 256:
            raise ValueError(f"Q4_K needs in_features divisible by 256, got {cols}")
        b = raw.reshape(rows, cols // 256, 144)
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, qs = b[..., 4:16].astype(np.uint8), b[..., 16:]
        scale = np.empty((*sc.shape[:-1], 8), np.uint8)
        mins = np.empty_like(scale)
        scale[..., :4], mins[..., :4] = sc[..., 0:4] & 63, sc[..., 4:8] & 63
        scale[..., 4:] = (sc[..., 8:12] & 0x0F) | ((sc[..., 0:4] >> 6) << 4)
        mins[..., 4:] = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
        qs = qs.reshape(*qs.shape[:-1], 4, 32)  # four runs of 32 bytes: sub-blocks 2c (low), 2c + 1 (high)
        q = np.stack([qs & 0x0F, qs >> 4], axis=-2)  # [..., 4, 2, 32]
        s = d[..., None] * scale.astype(np.float32)
        m = -(dmin[..., None] * mins.astype(np.float32))
        return q.reshape(rows, cols), s.reshape(rows, nb), m.reshape(rows, nb), 4
    return requantize_8bit(np.asarray(dequantize(raw, tensor_type), np.float32).reshape(rows, cols))


def _requantize(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Float weights [rows, cols] as `bits`-bit blocks of 32 with their own min and max (asymmetric)."""
    levels = float((1 << bits) - 1)
    rows, cols = w.shape
    b = w.reshape(rows, cols // BLOCK, BLOCK).astype(np.float32)
    lo, hi = b.min(-1), b.max(-1)
    s = ((hi - lo) / levels).astype(np.float32)
    inv = np.where(s > 0, 1.0 / np.where(s > 0, s, 1.0), 0.0).astype(np.float32)
    q = np.clip(np.rint((b - lo[..., None]) * inv[..., None]), 0, levels).astype(np.uint8)
    return q.reshape(rows, cols), s, lo.astype(np.float32), bits


def requantize_8bit(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Float weights [rows, cols] as 8-bit blocks of 32 with their own min and max (asymmetric)."""
    return _requantize(w, 8)


def requantize_4bit(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Float weights [rows, cols] as 4-bit blocks of 32 with their own min and max (Q4_1's scheme): for
    timing and for a checkpoint without a GGUF (`tdpipe bench gemm`, the step-cost profile)."""
    return _requantize(w, 4)


def is_block_quantized(tensor_type: Any) -> bool:
    """A quantised type (not a plain float) that the GEMM can keep: all of them, some via 8 bits."""
    return tensor_type not in FLOAT_TYPES


__all__ = ["BLOCK", "EXACT_4BIT", "EXACT_8BIT", "blocks_of", "is_block_quantized", "requantize_4bit",
           "requantize_8bit"]
