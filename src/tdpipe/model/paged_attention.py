"""Attention over the paged KV cache: C++/OpenMP kernel on CPU, Triton kernels on CUDA, pure-torch reference.

Cache layout (per layer): ``k_cache`` / ``v_cache`` of shape [num_blocks, num_kv_heads, block_size, head_dim]
(int8 caches: [..., width], each row head_dim int8 values and its float32 scale, model/kv_quant.py).
Token ``t`` of a sequence lives in block ``block_tables[s, t // block_size]`` at offset ``t % block_size``.
A batch is described varlen-style: sequence ``s`` owns query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``
(the last ``n_s`` of its ``seq_lens[s]`` tokens, whose K/V are already stored) and attends causally.

Sliding window W (``sliding_window``; None or 0: global attention): query position p sees keys p-W+1 .. p,
itself included (transformers' ``kv_idx > q_idx - sliding_window``). Every path then reads, per sequence,
only the blocks from the one holding its first query's window start (position ``seq_len - n_s - W + 1``)
on: the block-table entries before it are never looked up, so a cache manager may free those blocks and
leave stale ids behind. The K/V of every position from there on must be stored.

Backends: CPU tensors take the C++ kernel (model/triton_attention.py is never imported for them); CUDA
tensors take the Triton kernels (model/triton_attention.py; run on an H200, sliding window and Gemma 2's
soft-cap not yet: those two are checked under Triton's interpreter only).
TDPIPE_ATTENTION_BACKEND=triton (or set_attention_backend("triton")) sends CPU tensors through the Triton
kernels too, run by Triton's interpreter: the engine's GPU attention path, checked on a CPU (about 2000x
slower than compiled; tests only).
"""
from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from types import ModuleType

import torch
import torch.nn.functional as F

from tdpipe.model import kv_quant
from tdpipe.model.jit import build

logger = logging.getLogger(__name__)

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.int8)  # int8: rows with scales (model/kv_quant.py)
_Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

IntSeq = torch.Tensor | Sequence[int]

BACKEND_ENV = "TDPIPE_ATTENTION_BACKEND"  # read once, at import: each engine process reads its own
BACKENDS = ("auto", "triton")
_force_triton = False


def set_attention_backend(name: str) -> None:
    """"auto": CPU tensors take the C++ kernel, CUDA tensors the Triton kernels. "triton": CPU tensors take
    the Triton kernels too, interpreted (a check of the GPU path on a CPU; far too slow for real use).
    The process starts with $TDPIPE_ATTENTION_BACKEND (default auto). A flag, not a per-call env look-up:
    os.environ.get costs ~1.4 us, twice per layer on the CPU path."""
    global _force_triton
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} ({BACKEND_ENV}): expected one of {', '.join(BACKENDS)}")
    _force_triton = name == "triton"


set_attention_backend(os.environ.get(BACKEND_ENV) or "auto")


def use_triton(t: torch.Tensor) -> bool:
    """Does attention on t's device run through the Triton kernels? CUDA always, CPU when the backend is
    forced to triton, other devices never (the pure-torch reference)."""
    return t.is_cuda or (_force_triton and t.device.type == "cpu")


def _triton() -> ModuleType:
    """The Triton kernels' module, imported on first use (CPU runs need no triton import, ~0.2 s)."""
    from tdpipe.model import triton_attention

    return triton_attention


def load_kernel() -> ModuleType | None:
    """The compiled kernel (JIT-built once per machine, 20-60 s), or None: pure-torch path."""
    return build("tdpipe_paged_attention", "paged_attention.cpp")


def _int_tensor(x: IntSeq, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.to(device=device if device is not None else x.device, dtype=dtype).contiguous()
    return torch.tensor(list(x), dtype=dtype, device=device)


def _as_list(x: IntSeq) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else [int(v) for v in x]


# ----------------------------------------------------------------------------------------------------
# store_kv
# ----------------------------------------------------------------------------------------------------


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Write k[t], v[t] ([T, Hkv, D]) into slot slot_mapping[t] of the caches; slot -1 is skipped."""
    bs = k_cache.shape[2]
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    blk, off = slots // bs, slots % bs
    if kv_quant.is_int8(k_cache):  # int8 rows and their scales (model/kv_quant.py)
        k, v = kv_quant.quantize_rows(k), kv_quant.quantize_rows(v)
    # Advanced indices around a slice put the indexed dim first: k_cache[blk, :, off] is [N, Hkv, D].
    k_cache[blk, :, off] = k.to(k_cache.dtype)
    v_cache[blk, :, off] = v.to(v_cache.dtype)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter the new tokens' K/V into the paged cache (in place)."""
    if use_triton(k_cache):
        _no_int8_triton(k_cache)
        _triton().store_kv(k, v, k_cache, v_cache, slot_mapping)
        return
    kern = load_kernel()
    if kern is None or k_cache.dtype not in _KERNEL_DTYPES or k.device.type != "cpu":
        store_kv_ref(k, v, k_cache, v_cache, slot_mapping)
        return
    if kv_quant.is_int8(k_cache):  # the kernel quantises bf16 / fp32 rows as it stores them
        if k.dtype not in (torch.float32, torch.bfloat16):
            k, v = k.float(), v.float()
        if v.dtype != k.dtype:
            v = v.to(k.dtype)
    elif k.dtype != k_cache.dtype:
        k, v = k.to(k_cache.dtype), v.to(k_cache.dtype)
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    kern.store_kv(k, v, k_cache, v_cache, _int_tensor(slot_mapping, torch.long))


# ----------------------------------------------------------------------------------------------------
# paged_attention
# ----------------------------------------------------------------------------------------------------


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: IntSeq,
                        cu_seqlens_q: IntSeq, seq_lens: IntSeq, scale: float,
                        seqs: Sequence[int] | None = None, out: torch.Tensor | None = None,
                        sliding_window: int | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Reference: per sequence, gather its blocks, dense fp32 attention with a causal mask. Any device.
    `seqs`: only these sequences (their rows of `out`, which it then fills in place). `sliding_window` W:
    query position p sees keys p-W+1 .. p only; blocks wholly before the first query's window are skipped.
    `softcap` c > 0: scores become c * tanh(scores / c) before the mask (Gemma 2)."""
    t, hq, d = q.shape
    hkv, bs = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    if out is None:
        out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    cu, lens = _as_list(cu_seqlens_q), _as_list(seq_lens)
    bt = block_tables if isinstance(block_tables, torch.Tensor) else torch.tensor(block_tables)
    bt = bt.to(device=k_cache.device, dtype=torch.long)
    for s in range(len(lens)) if seqs is None else seqs:
        seq_len = lens[s]
        q0, q1 = cu[s], cu[s + 1]
        n = q1 - q0
        if n == 0:
            continue
        nb = -(-seq_len // bs)
        b0 = max(0, seq_len - n - sliding_window + 1) // bs if sliding_window else 0
        blocks = bt[s, b0:nb]
        # [nb - b0, Hkv, bs, D] -> [Hkv, (nb - b0) * bs, D] -> tokens b0 * bs .. seq_len - 1
        k, v = (_rows(c[blocks], d).transpose(0, 1).reshape(hkv, -1, d)[:, :seq_len - b0 * bs]
                for c in (k_cache, v_cache))
        qs = q[q0:q1].float().reshape(n, hkv, g, d).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
        scores = torch.matmul(qs, k.unsqueeze(1).transpose(-1, -2)) * scale  # [Hkv, G, n, L]
        if softcap:
            scores = soft_cap(scores, softcap)
        qpos = torch.arange(seq_len - n, seq_len, device=q.device)
        kpos = torch.arange(b0 * bs, seq_len, device=q.device)
        mask = kpos[None, :] > qpos[:, None]  # [n, L]
        if sliding_window:
            mask |= kpos[None, :] <= qpos[:, None] - sliding_window
        scores.masked_fill_(mask, float("-inf"))
        o = torch.matmul(torch.softmax(scores, dim=-1), v.unsqueeze(1))  # [Hkv, G, n, D]
        out[q0:q1] = o.permute(2, 0, 1, 3).reshape(n, hq, d).to(q.dtype)
    return out


def _rows(cache_rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """float32 keys or values [..., head_dim] of cache rows (int8 rows dequantised with their scales)."""
    if kv_quant.is_int8(cache_rows):
        return kv_quant.dequantize_rows(cache_rows, head_dim)
    return cache_rows.float()


def _no_int8_triton(cache: torch.Tensor) -> None:
    if kv_quant.is_int8(cache):
        raise ValueError("an int8 KV cache (kv_cache_dtype 'int8') runs through the CPU kernel only; the Triton "
                         "kernels read bf16 / fp16 / fp32 caches")


def _attention_kernel(q: torch.Tensor, k_cache: torch.Tensor) -> ModuleType | None:
    """The C++ kernel when it can take this q and cache (CPU, supported dtypes, head_dim <= 256), else None."""
    if (q.device.type != "cpu" or k_cache.device.type != "cpu" or k_cache.dtype not in _KERNEL_DTYPES
            or q.dtype not in _Q_DTYPES or q.shape[-1] > 256):
        return None
    return load_kernel()


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: IntSeq,
                    cu_seqlens_q: IntSeq, seq_lens: IntSeq, scale: float,
                    sliding_window: int | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over cached K/V; returns [T, Hq, D] in q's dtype.

    block_tables int32 [S, max_blocks], cu_seqlens_q int32 [S+1], seq_lens int32 [S] (lists accepted).
    `sliding_window` W (None / 0: none): each query sees its last W keys, itself included; blocks wholly
    before a sequence's first query's window are not read (module docstring). `softcap` c > 0: scores
    become c * tanh(scores / c) before the mask (Gemma 2's attn_logit_softcapping).
    """
    if use_triton(q):
        _no_int8_triton(k_cache)
        return _triton().paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                                         sliding_window=sliding_window, softcap=softcap)
    window = int(sliding_window or 0)
    kern = _attention_kernel(q, k_cache)
    if kern is None:
        return paged_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                                   sliding_window=window, softcap=softcap)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if not isinstance(block_tables, torch.Tensor):
        block_tables = torch.tensor(block_tables, dtype=torch.int32)
    if scalar_kernel(kern):
        cu = _as_list(cu_seqlens_q)
        chunks = [s for s in range(len(cu) - 1) if cu[s + 1] - cu[s] > 1]
        if chunks:
            return _split_by_query_len(kern, q, k_cache, v_cache, block_tables, cu, seq_lens, scale, chunks,
                                       window, softcap)
    return kern.paged_attention(q, k_cache, v_cache, _int_tensor(block_tables, torch.int32),
                                _int_tensor(cu_seqlens_q, torch.int32), _int_tensor(seq_lens, torch.int32),
                                float(scale), window, float(softcap))


@functools.cache
def scalar_kernel(kern: ModuleType) -> bool:
    """Was the kernel built without AVX2 or AVX-512 (its portable loops)? There it runs ~2-3 GFLOP/s whatever
    the query length: twice the torch path's speed for decode rows, but 4-8x slower than it on prefill chunks
    (one thread, float32, AMD EPYC: a 512-token chunk over 1024 cached tokens 426 ms vs 81 ms). The AVX2
    path is not: on chunks at least as fast as the torch path (2 threads, 4 x 256 queries over 1024 keys: fp32
    44-49 ms against 46-118 ms in three runs, bf16 33 ms against 87 ms), on decode 3.3-4.5x the portable loops
    (bench_results/avx2/attention_*.txt)."""
    return kern.kernel_info().startswith("scalar")


def _split_by_query_len(kern: ModuleType, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, cu: list[int], seq_lens: IntSeq, scale: float,
                        chunks: list[int], window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Decode rows (one query each) through the kernel, prefill chunks through the torch path."""
    out = torch.empty_like(q)
    lens = _as_list(seq_lens)
    decode = [s for s in range(len(cu) - 1) if cu[s + 1] - cu[s] == 1]
    if decode:
        rows = torch.tensor([cu[s] for s in decode], dtype=torch.long, device=q.device)
        idx = torch.tensor(decode, dtype=torch.long, device=block_tables.device)
        out[rows] = kern.paged_attention(q[rows].contiguous(), k_cache, v_cache,
                                         block_tables[idx].to(torch.int32).contiguous(),
                                         torch.arange(len(decode) + 1, dtype=torch.int32),
                                         torch.tensor([lens[s] for s in decode], dtype=torch.int32),
                                         float(scale), window, float(softcap))
    return paged_attention_ref(q, k_cache, v_cache, block_tables, cu, lens, scale, seqs=chunks, out=out,
                               sliding_window=window, softcap=softcap)


# ----------------------------------------------------------------------------------------------------
# prefill without a cached prefix
# ----------------------------------------------------------------------------------------------------


def kernel_prefill(q: torch.Tensor, k_cache: torch.Tensor, sliding_window: int | None = None) -> bool:
    """Should fresh prompts (no cached prefix) attend through the paged kernel rather than SDPA? Yes for
    bf16 on CPU: their K/V are already stored, and the kernel runs 2-2.4x faster than torch's CPU flash
    SDPA (2048 prompt tokens over 8 prompts, one layer: 10 ms vs 25 ms), about a tenth of a prefill
    layer. float32 keeps SDPA, the path that matches transformers bit for bit. An int8 cache always takes
    the kernel (or the reference): a prompt then sees the quantised keys and values every later step reads,
    and perplexity measures the cache's loss. A sliding window does not
    change the choice: both paths take it (the kernel then reads only each query's window, SDPA masks a
    dense [n, n] band), so the caller passes the same `sliding_window` to whichever runs."""
    del sliding_window  # same answer with or without a window (see above)
    if kv_quant.is_int8(k_cache):  # the quantised cache, as every later step reads it (model/kv_quant.py)
        return True
    if use_triton(q):  # Triton: one launch for the whole batch; float32 keeps SDPA as on CPU
        return q.dtype == k_cache.dtype and q.dtype in (torch.bfloat16, torch.float16)
    return q.dtype == k_cache.dtype == torch.bfloat16 and _attention_kernel(q, k_cache) is not None


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: IntSeq,
                      scale: float, sliding_window: int | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Causal self-attention of fresh sequences packed varlen-style (q [T, Hq, D], k/v [T, Hkv, D]).

    Uses SDPA; sequences of equal length are batched into one call. `sliding_window` W (None / 0: none):
    query i sees keys i-W+1 .. i. A sequence of at least W tokens gets an explicit banded causal mask, as
    transformers' SDPA path builds it (shorter ones keep `is_causal`, where the band changes nothing).
    `softcap` c > 0 (Gemma 2): SDPA cannot cap its scores, so the scores are computed as transformers' eager
    attention computes them, c * tanh(scores / c), then the mask and a float32 softmax.
    """
    cu = _as_list(cu_seqlens)
    t, hq, d = q.shape
    gqa = hq != k.shape[1]
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    by_len: dict[int, list[int]] = {}
    for s in range(len(cu) - 1):
        if cu[s + 1] > cu[s]:
            by_len.setdefault(cu[s + 1] - cu[s], []).append(cu[s])
    for n, starts in by_len.items():
        if len(starts) == 1:
            rows: slice | torch.Tensor = slice(starts[0], starts[0] + n)
            qs, ks, vs = (x[rows].transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, n, D]
        else:
            first = torch.tensor(starts, device=q.device)[:, None]
            rows = (first + torch.arange(n, device=q.device)).reshape(-1)
            qs, ks, vs = (x[rows].view(len(starts), n, x.shape[1], d).transpose(1, 2) for x in (q, k, v))
        if softcap:
            o = _capped_attention(qs, ks, vs, _band_mask(n, sliding_window or n, q.device), scale, softcap)
        elif sliding_window and n >= sliding_window:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=_band_mask(n, sliding_window, q.device),
                                               scale=scale, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
        out[rows] = o.transpose(1, 2).reshape(-1, hq, d)
    return out


def soft_cap(x: torch.Tensor, c: float) -> torch.Tensor:
    """c * tanh(x / c): Gemma 2's soft-cap of attention scores and of logits, as transformers computes it."""
    return torch.tanh(x / c) * c


def _capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                      softcap: float) -> torch.Tensor:
    """Attention with soft-capped scores, op for op as transformers' eager Gemma 2 attention in float32:
    q [B, Hq, n, D], k/v [B, Hkv, n, D], mask bool [n, n] (True: may see). bf16 inputs are computed in float32
    too (scores near the cap, 50, keep 2-3 bits after the point in bf16), the output cast back."""
    dtype = q.dtype
    q, k, v = q.float(), k.float(), v.float()
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    w = soft_cap(torch.matmul(q, k.transpose(-1, -2)) * scale, softcap)
    w = w.masked_fill(~mask, torch.finfo(w.dtype).min)
    return torch.matmul(torch.softmax(w, dim=-1), v).to(dtype)


def _band_mask(n: int, window: int, device: torch.device) -> torch.Tensor:
    """bool [n, n], True where query i may see key j: i - window < j <= i."""
    i = torch.arange(n, device=device)
    diff = i[:, None] - i[None, :]
    return (diff >= 0) & (diff < window)
