"""`--quantization gguf`: a model slice's linears, and its tied embedding / lm_head, built from a GGUF file's
quantised blocks as they are stored (model/gguf_blocks.py), packed for the block GEMM (model/block_linear.py).

The slice first loads the file's bf16 conversion as usual (norms, biases, anything kept in float); the
linear weights are then replaced by the file's integer blocks, read straight from the file (memory-mapped),
so their values are the file's and no float passes between the file and the packed weights. The same
transforms the conversion applies are applied to the blocks: llama.cpp's q/k row order undone (whole rows
move, blocks run along a row), a tensor-parallel rank's rows or columns cut (columns on 32-aligned bounds),
fused q|k|v and gate|up concatenated.

The file's tensor table is read here without gguf-py's reader, which parses every metadata array (Gemma 3's
262,144-token vocabulary: 11 s) where only the table after them is needed.
"""
from __future__ import annotations

import functools
import mmap
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from torch import nn

from tdpipe.model.block_linear import (BlockEmbedding, BlockLinear, as_tensors, gemm_path, replace_decoder_linears,
                                      shard_blocks)
from tdpipe.model.gguf import unpermute_rope_rows
from tdpipe.model.gguf_blocks import BLOCK, blocks_of, is_block_quantized, requantize_4bit

# GGUF metadata value types with a fixed size (gguf's GGUFValueType numbering): bytes per value
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
# the model's fused linears -> the GGUF parts they are made of, in order
PARTS = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "self_attn.o_proj": ("attn_output",),
         "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}
HF_PART = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
           "ffn_down": "mlp.down_proj"}


class TensorTable:
    """name -> (type, [rows, cols], data bytes) of a GGUF file, the data memory-mapped."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf, pos = self._map, 0
        magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{path}: not a GGUF v2+ file")
        pos = 24
        alignment, self.arch = 32, ""

        def string(p: int) -> tuple[bytes, int]:
            (n,) = struct.unpack_from("<Q", buf, p)
            return buf[p + 8:p + 8 + n], p + 8 + n

        def skip(kind: int, p: int) -> int:
            if kind in _FIXED:
                return p + _FIXED[kind]
            if kind == _STRING:
                return string(p)[1]
            if kind == _ARRAY:
                sub, count = struct.unpack_from("<IQ", buf, p)
                p += 12
                if sub in _FIXED:
                    return p + _FIXED[sub] * count
                for _ in range(count):
                    p = skip(sub, p)
                return p
            raise ValueError(f"{path}: unknown GGUF metadata type {kind}")

        for _ in range(n_kv):
            key, pos = string(pos)
            (kind,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            if key == b"general.alignment" and kind == 4:
                (alignment,) = struct.unpack_from("<I", buf, pos)
            elif key == b"general.architecture" and kind == _STRING:
                self.arch = string(pos)[0].decode()
            pos = skip(kind, pos)
        infos = []
        for _ in range(n_tensors):
            name, pos = string(pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name.decode(), GGMLQuantizationType(kind), dims, offset))
        start = -(-pos // alignment) * alignment
        self.tensors: dict[str, tuple[Any, tuple[int, int], int]] = {}
        for name, kind, dims, offset in infos:
            cols = int(dims[0])
            rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
            self.tensors[name] = (kind, (rows, cols), start + offset)

    @property
    def permute_qk(self) -> bool:
        """llama.cpp permuted q/k rows for this architecture (model/gguf_families.py's permute_qk)."""
        from tdpipe.model.gguf_families import FAMILIES

        return FAMILIES[self.arch].permute_qk if self.arch in FAMILIES else False

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes, uint8 [rows, bytes per row] (memory-mapped, not copied)."""
        kind, (rows, cols), at = self.tensors[name]
        block, size = GGML_QUANT_SIZES[kind]
        per_row = cols // block * size
        return np.frombuffer(self._map, np.uint8, rows * per_row, at).reshape(rows, per_row)

    def blocks(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        kind, (rows, cols), _ = self.tensors[name]
        return blocks_of(kind, self.raw(name), rows, cols)


@functools.cache
def tensor_table(path: str) -> TensorTable:
    return TensorTable(path)


def has_quantized_linears(path: str) -> bool:
    """Whether the file's decoder linears are stored quantised (what `auto` keeps)."""
    t = tensor_table(path).tensors
    kinds = [k for name, (k, _, _) in t.items() if re.fullmatch(r"blk\.\d+\.(attn_q|ffn_down)\.weight", name)]
    return bool(kinds) and all(is_block_quantized(k) for k in kinds)


def _linear_from(table: TensorTable, model: Any, layer: int, parts: tuple[str, ...],
                 bias: torch.Tensor | None) -> BlockLinear | None:
    cfg = model.cfg
    got = []
    for part in parts:
        name = f"blk.{layer}.{part}.weight"
        if name not in table.tensors or not is_block_quantized(table.tensors[name][0]):
            return None  # a float tensor stays in the float linear
        q, s, m, bits = table.blocks(name)
        if part in ("attn_q", "attn_k") and table.permute_qk:
            heads = cfg.num_heads if part == "attn_q" else cfg.num_kv_heads
            q, s, m = (unpermute_rope_rows(torch.from_numpy(np.ascontiguousarray(a)), heads).numpy()
                       for a in (q, s, m))
        q, s, m = shard_blocks(model, f"model.layers.{layer}.{HF_PART[part]}.weight", q, s, m)
        got.append((q, s, m, bits))
    bits = 4 if all(g[3] == 4 for g in got) else 8  # a 4-bit part beside an 8-bit one: as 8 bits, exactly
    q, s, m = (np.concatenate([g[i] for g in got]) for i in range(3))
    return BlockLinear(*as_tensors(q, s, m), bits, bias)


def keep_gguf_blocks(model: nn.Module, gguf_file: str) -> int:
    """Replace the slice's linears (and a quantised tied embedding / lm_head) by the file's packed blocks;
    returns how many modules were replaced."""
    gemm_path()  # the one-line notice of the code path
    table = tensor_table(gguf_file)
    n = replace_decoder_linears(model, PARTS,
                                lambda idx, attr, old: _linear_from(table, model, idx, PARTS[attr], old.bias))
    return n + _keep_head(model, table)


def _keep_head(model: Any, table: TensorTable) -> int:
    """The lm_head from output.weight (or the tied token_embd) and the embedding from token_embd, one packed
    copy when both are the same rows of one tensor."""
    cfg = model.cfg
    head_name = "token_embd.weight" if cfg.tie_word_embeddings or "output.weight" not in table.tensors \
        else "output.weight"
    n, head = 0, None
    if getattr(model, "lm_head", None) is not None and is_block_quantized(table.tensors[head_name][0]):
        q, s, m, bits = table.blocks(head_name)
        a, b = model.head_range
        head = BlockLinear(*as_tensors(q[a:b], s[a:b], m[a:b]), bits)
        model.lm_head, n = head, n + 1
    emb = model.embed_tokens
    if emb is not None and is_block_quantized(table.tensors["token_embd.weight"][0]):
        dtype = emb.weight.dtype
        same = head is not None and head_name == "token_embd.weight" and model.head_range == (emb.start, emb.end)
        if not same:
            q, s, m, bits = table.blocks("token_embd.weight")
            head_like = BlockLinear(*as_tensors(q[emb.start:emb.end], s[emb.start:emb.end],
                                                m[emb.start:emb.end]), bits)
        model.embed_tokens = BlockEmbedding(head if same else head_like, emb.start, emb.end, emb.tp, dtype)
        n += 1
    return n


def quantize_blocks_from_float(model: nn.Module) -> int:
    """4-bit blocks of every decoder linear's float weight (no file: the step-cost profile's random layer)."""
    n = 0
    for mod in list(model.modules()):
        for name, child in list(mod.named_children()):
            if isinstance(child, nn.Linear) and name != "lm_head":
                w = child.weight.detach().float().numpy()
                q, s, m, bits = requantize_4bit(w)
                setattr(mod, name, BlockLinear(*as_tensors(q, s, m), bits, child.bias))
                n += 1
    return n


__all__ = ["HF_PART", "PARTS", "TensorTable", "has_quantized_linears", "keep_gguf_blocks",
           "quantize_blocks_from_float", "tensor_table"]
