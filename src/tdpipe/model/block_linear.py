"""Linear layers and embeddings over block-quantised weights kept packed in memory (`--quantization gguf`):
4-bit (W4A8) or 8-bit (W8A8) per block of 32 along K, int8 activations per block of 32, int32 dots.

    w[n, k] = s[n, b] q[n, k] + m[n, b],  x[r, k] ~ dx[r, b] xq[r, k]   (b = k // 32; model/gguf_blocks.py)
    y[r, n] = sum_b dx[r, b] (s[n, b] sum_k q[n, k] xq[r, k]) + m[n, b] dx[r, b] sum_k xq[r, k]

Why blocks and not W8A8's one scale per channel and per token: GGUF's scales are per block, so the file's
integers are used as they are (no float round trip, 4-bit weights stay 4 bits), and an activation scale per
32 values (llama.cpp's Q8_0 activations) loses far less than one per token. The GEMM is tdpipe's own
(csrc/qgemm.cpp: VNNI VPDPBUSD on 4-bit weights unpacked in registers; a portable loop without VNNI); the
pure-torch fallback (no kernel) dequantises the weight at every call and computes the same sums in float.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from tdpipe.model import cpu_ops
from tdpipe.model.gguf_blocks import BLOCK, requantize_4bit

TILE = 16  # output channels per packed tile: one AVX-512 register of lanes (csrc/qgemm.cpp)


@functools.cache
def gemm_path() -> str:
    """Which code runs the block GEMM, said once on stderr by the first quantised model."""
    k = cpu_ops.kernel()
    path = k.qgemm_path() if k is not None else "pure torch (kernel unavailable: dequantise, then matmul)"
    from tdpipe.model.cache import notice

    notice(f"quantised weights kept packed; block GEMM: {path}")
    return path


def vector_block_gemm() -> bool:
    """The block GEMM runs a register kernel here, VNNI or AVX2 (not the portable loop: 1-5 GOP/s on an AVX2
    EPYC, where its AVX2 kernel runs 60-67 on one core)."""
    k = cpu_ops.kernel()
    return k is not None and not k.qgemm_path().startswith("portable")


def pack(q: torch.Tensor, s: torch.Tensor, m: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [tiles, K/32, 256 | 512], scales [tiles, K/32, 2, 16]) from q uint8 [N, K] and s, m
    float32 [N, K/32]: the layout csrc/qgemm.cpp reads. Scales are kept in fp16 where that holds them
    exactly (Q4_0, Q4_1, Q8_0, Q5_0 come from fp16), else fp32 (Q4_K's d * sc)."""
    n, k = q.shape
    kb, tiles = k // BLOCK, -(-n // TILE)
    pad = tiles * TILE - n
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        s, m = torch.cat([s, s.new_zeros(pad, kb)]), torch.cat([m, m.new_zeros(pad, kb)])
    g = q.view(tiles, TILE, kb, 8, 4).permute(0, 2, 3, 1, 4)  # [tiles, kb, group, lane, 4]
    if bits == 4:
        packed = (g[:, :, :4] | (g[:, :, 4:] << 4)).reshape(tiles, kb, 256)
    else:
        packed = g.reshape(tiles, kb, 512)
    sm = torch.stack([s, m], dim=-1).view(tiles, TILE, kb, 2).permute(0, 2, 3, 1).contiguous()
    half = sm.half()
    if torch.equal(half.float(), sm) and bool(torch.isfinite(half).all()):
        sm = half
    return packed.contiguous(), sm


def unpack_rows(packed: torch.Tensor, scales: torch.Tensor, bits: int, rows: torch.Tensor) -> torch.Tensor:
    """Float32 weights [len(rows), K] of the given output channels: s * q + m, the values gguf-py's
    dequantise gives (an embedding lookup, the torch fallback)."""
    tiles, kb = packed.shape[:2]
    t, lane = rows // TILE, rows % TILE
    if bits == 4:
        b = packed.view(tiles, kb, 4, TILE, 4)[t, :, :, lane]  # [R, kb, 4, 4]
        q = torch.cat([b & 0x0F, b >> 4], dim=2)  # groups 0..3 low, 4..7 high
    else:
        q = packed.view(tiles, kb, 8, TILE, 4)[t, :, :, lane]
    sm = scales.view(tiles, kb, 2, TILE)[t, :, :, lane].float()  # [R, kb, 2]
    w = q.reshape(len(rows), kb, BLOCK).float() * sm[..., 0:1] + sm[..., 1:2]
    return w.reshape(len(rows), kb * BLOCK)


def quantize_blocks_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(xq int8 [M, K], dx [M, K/32], cx [M, K/32]): the kernel's activation blocks, same bits."""
    m, k = x.shape
    b = x.float().reshape(m, k // BLOCK, BLOCK)
    amax = b.abs().amax(-1)
    inv = torch.where(amax > 0, amax.new_full(amax.shape, 127.0) / amax, 0.0)
    q = torch.round(b * inv[..., None]).clamp_(-127, 127)
    dx = amax / 127.0
    return q.to(torch.int8).reshape(m, k), dx, dx * q.sum(-1)


class BlockLinear(nn.Module):
    """y = x W^T (+ b) over packed block-quantised weights (module docstring). Inference only."""

    def __init__(self, q: torch.Tensor, s: torch.Tensor, m: torch.Tensor, bits: int,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.bits = bits
        packed, scales = pack(q, s, m, bits)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else bias.detach().float().contiguous()

    @classmethod
    def from_float(cls, linear: nn.Linear, bits: int = 4) -> "BlockLinear":
        """4-bit (Q4_1's min/max scheme) blocks of a float linear: a stand-in of the GGUF path's shape."""
        from tdpipe.model.gguf_blocks import requantize_8bit

        w = linear.weight.detach().float().numpy()
        q, s, m, b = (requantize_4bit if bits == 4 else requantize_8bit)(w)
        return cls(torch.from_numpy(q), torch.from_numpy(s), torch.from_numpy(m), b, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).contiguous()
        k = cpu_ops.kernel()
        if k is not None and x2.device.type == "cpu" and x2.dtype in (torch.bfloat16, torch.float32):
            xq, dx, cx = k.quantize_blocks(x2)
            y = k.qgemm(xq, dx, cx, self.packed, self.scales, self.out_features, self.bits, self.bias, x.dtype)
        else:
            y = self.reference(x2).to(x.dtype)
        return y.view(*shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [N, K] (what `--quantization none` loads, before its bf16 cast)."""
        return unpack_rows(self.packed, self.scales, self.bits, torch.arange(self.out_features))

    def reference(self, x2: torch.Tensor) -> torch.Tensor:
        """The same sums in float32 torch ops (the fallback, and the tests' reference)."""
        xq, dx, _ = quantize_blocks_torch(x2)
        xd = (xq.float().view(len(x2), -1, BLOCK) * dx[..., None]).view_as(x2)
        y = xd @ self.dequantized().t()
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"w{self.bits}a8 per block of {BLOCK}")


class BlockEmbedding(nn.Module):
    """A vocabulary-parallel embedding over packed blocks (a tied lm_head's, shared with it): the rows
    looked up are dequantised on the fly, float32 then the run's dtype, as the bf16 conversion rounds them."""

    def __init__(self, head: BlockLinear, start: int, end: int, tp: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.head, self.start, self.end, self.tp, self.dtype = head, start, end, tp, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.head
        if self.tp.size == 1:
            return unpack_rows(h.packed, h.scales, h.bits, ids.reshape(-1)).to(self.dtype)
        mine = (ids >= self.start) & (ids < self.end)
        x = unpack_rows(h.packed, h.scales, h.bits, torch.where(mine, ids - self.start, 0)).to(self.dtype)
        x.masked_fill_(~mine[:, None], 0)
        return self.tp.all_reduce_(x)


def resident_bytes(module: nn.Module) -> int:
    """Bytes of every tensor the module holds (parameters, buffers, a PackedLinear's oneDNN weight), each
    storage counted once: the weights' resident memory."""
    seen: set[int] = set()
    total = 0
    for mod in module.modules():
        tensors = list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False))
        tensors += [v for v in vars(mod).values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            try:
                st = t.untyped_storage()
                key, nbytes = st.data_ptr(), st.nbytes()
            except (RuntimeError, NotImplementedError):  # an opaque oneDNN tensor: its elements
                key, nbytes = id(t), t.numel() * t.element_size()
            if key not in seen and t.device.type != "meta":
                seen.add(key)
                total += nbytes
    return total


def replace_decoder_linears(model: Any, attrs: Iterable[str],
                            build: Callable[[int, str, nn.Linear], "BlockLinear | None"]) -> int:
    """Replace each decoder layer's float linear at `attrs` ("self_attn.qkv_proj", ...) by what
    build(layer index, attr, old linear) returns (None: keep it); returns how many were replaced."""
    n = 0
    for local, layer in enumerate(model.layers):
        idx = model.start_layer + local
        for attr in attrs:
            parent_name, leaf = attr.split(".")
            parent = getattr(layer, parent_name)
            old = getattr(parent, leaf)
            if not isinstance(old, nn.Linear):
                continue
            new = build(idx, attr, old)
            if new is not None:
                setattr(parent, leaf, new)
                n += 1
    return n


def shard_blocks(model: Any, hf_name: str, q: Any, s: Any, m: Any) -> tuple:
    """This rank's part of a checkpoint weight's blocks (model.shard_of: rows, or 32-aligned columns); numpy
    arrays or tensors alike, [N, K] and [N, K / 32]."""
    shard = model.shard_of(hf_name)
    if shard is None:
        return q, s, m
    dim, a, b = shard
    if dim == 0:
        return q[a:b], s[a:b], m[a:b]
    if a % BLOCK or b % BLOCK:
        raise ValueError(f"{hf_name}: a tensor-parallel column shard [{a}, {b}) is not on {BLOCK}-column "
                         "block bounds; use --quantization none")
    return q[:, a:b], s[:, a // BLOCK:b // BLOCK], m[:, a // BLOCK:b // BLOCK]


def as_tensors(q: np.ndarray, s: np.ndarray, m: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """numpy blocks (memory-mapped slices included) as contiguous tensors for BlockLinear."""
    return torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(np.ascontiguousarray(s)), \
        torch.from_numpy(np.ascontiguousarray(m))


__all__ = ["BlockEmbedding", "BlockLinear", "TILE", "as_tensors", "gemm_path", "pack", "quantize_blocks_torch",
           "replace_decoder_linears", "resident_bytes", "shard_blocks", "unpack_rows"]
