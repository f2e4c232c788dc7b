"""Prefill/decode disaggregation's KV transfer on the worker side (DistServe; the lecture's §4): a staging
area in shared memory that a prefill instance writes a finished prompt's KV blocks into and a decode instance
reads them from, block by block.

The area is a file under /dev/shm mapped by every instance's worker ([slots, layers, 2, kv_heads, block_size,
head_dim]: one slot holds one KV block of every layer). The control plane (core/kv_staging.py) hands out the
slots; a prefill step carries (block, slot) pairs to export after it computes, and the decode step that first
runs the request carries (slot, block) pairs to import before it computes. Ordering needs no lock: the engine
sends the import only after it collected the prefill step's result, and frees a slot only after the import's
step returned.
"""
from __future__ import annotations

import os

import torch


def staging_shape(num_slots: int, num_layers: int, num_kv_heads: int, block_size: int,
                  row: int) -> tuple[int, ...]:
    """`row`: the cache's last dimension (head_dim, or an int8 cache's row width, model/kv_quant.py)."""
    return (num_slots, num_layers, 2, num_kv_heads, block_size, row)


def create_staging_file(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Create (zeroed) the shared file; the engine does this once, before the workers map it."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    with open(path, "wb") as f:
        f.truncate(nbytes)


def map_staging(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The staging area as a tensor backed by the shared file: writes are seen by every process mapping it."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"KV staging file {path} is missing (the engine creates it before the workers)")
    return torch.from_file(path, shared=True, size=torch.Size(shape).numel(), dtype=dtype).view(shape)


def export_blocks(cache: torch.Tensor, staging: torch.Tensor, pairs: list[tuple[int, int]],
                  first_layer: int = 0) -> None:
    """staging[slot, layers] = cache[:, :, block] for every (block, slot) pair: a finished prompt's KV leaves the
    prefill instance's cache. `cache`: [layers of this slice, 2, blocks, Hkv, bs, D]."""
    n = cache.shape[0]
    for block, slot in pairs:
        staging[slot, first_layer:first_layer + n].copy_(cache[:, :, block])


def import_blocks(cache: torch.Tensor, staging: torch.Tensor, pairs: list[tuple[int, int]],
                  first_layer: int = 0) -> None:
    """cache[:, :, block] = staging[slot, layers] for every (slot, block) pair: the decode instance's cache gets
    the prompt's KV before its first decode step."""
    n = cache.shape[0]
    for slot, block in pairs:
        cache[:, :, block].copy_(staging[slot, first_layer:first_layer + n])


__all__ = ["create_staging_file", "export_blocks", "import_blocks", "map_staging", "staging_shape"]
