"""Paged attention in Triton, for CUDA tensors (and CPU tensors through Triton's interpreter).

Run on an H200 and an H100 (tests/gpu, docs/gpu.md) and checked on CPUs by Triton's interpreter against the
dense reference (tests/unit/test_triton_attention.py); the block sizes and warps are not tuned yet.

Same cache layout and batch description as model/paged_attention.py: per layer k_cache / v_cache
[num_blocks, num_kv_heads, block_size, head_dim]; sequence s owns query rows
cu_seqlens_q[s]:cu_seqlens_q[s+1], the last n_s of its seq_lens[s] tokens (their K/V already stored), and
attends causally. Three kernels:

- store_kv: scatter the new tokens' K/V into their slots (slot -1: padding, skipped).
- prefill (any batch, chunks with a cached prefix included): one program per (tile of query rows of one
  sequence, KV head). The tile's rows are (query position, query head of the GQA group) pairs, so each K/V
  tile read through the block table serves every query head sharing it; keys are consumed in tiles with an
  online softmax (FlashAttention-2), accumulated in float32. Programs find their sequence by binary search
  over cu_seqlens_q, so the grid needs only host-known sizes (no device-to-host sync).
- decode (one query row per sequence): flash-decoding. The context is cut into partitions; one program per
  (sequence, KV head, partition) computes a partial max / sum / output, and a second kernel combines them.
  With a single partition the first kernel writes the output directly.

Both attention kernels take an optional sliding window W: query position p sees keys p-W+1 .. p (Mistral /
Gemma convention, HF's `kv_idx > q_idx - sliding_window`), and an optional soft-cap c (Gemma 2): each score
s becomes c tanh(s / c) before the mask and softmax.

Kernels are wrapped lazily, for whichever mode triton runs in: model/triton_jit.py says why.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

# interpreted() stays importable from here (tests, callers that ask which mode ran)
from tdpipe.model.triton_jit import interpret_for, interpreted, kernel_set, launching, pow2, varying  # noqa: F401

IntSeq = torch.Tensor | Sequence[int]

PARTITION_SIZE = 512  # decode keys per split-K partition (vLLM's paged-attention v2 uses 512 too)
_LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------------
# kernel bodies (wrapped by _kernels; literals instead of module constants: jitted code reads no globals).
# Masks never combine a scalar condition with a block by `&` (Triton 3.9's interpreter then yields an int32
# mask it refuses); a scalar condition moves into a bound instead: r < where(cond, G, 0).
# ----------------------------------------------------------------------------------------------------


def _store_kv_body(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                   stride_kt, stride_kh, stride_vt, stride_vh,
                   stride_cb, stride_ch, stride_ct,
                   num_kv_heads, head_dim, block_size,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per token: its [Hkv, D] K and V rows into slot slot_mapping[t]."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk = slot // block_size
    off = slot % block_size
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < tl.where(slot >= 0, num_kv_heads, 0)) & (d < head_dim)
    dst = blk * stride_cb + h * stride_ch + off * stride_ct + d
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(kc_ptr + dst, k, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(vc_ptr + dst, v, mask=mask)


@varying("num_seqs", "stride_bt")
def _prefill_body(q_ptr, kc_ptr, vc_ptr, out_ptr, bt_ptr, cu_ptr, lens_ptr,
                  stride_qt, stride_qh, stride_ot, stride_oh,
                  stride_cb, stride_ch, stride_ct, stride_bt,
                  num_seqs, head_dim, block_size, qk_scale, window, cap2,
                  G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, USE_WINDOW: tl.constexpr, FP32_DOT: tl.constexpr,
                  SOFTCAP: tl.constexpr):
    """Program (tile, kv head). Sequence s owns tiles cu[s] // BLOCK_Q + s .. cu[s+1] // BLOCK_Q + s (an
    upper bound on its ceil(n_s / BLOCK_Q) tiles); spare tiles find no rows and store nothing."""
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    # Binary search: the last sequence whose first tile is <= pid.
    lo = pid * 0  # tensors from the start: num_seqs == 1 arrives as a constexpr, and loop-carried values
    hi = pid * 0 + num_seqs - 1  # must keep one type when compiled
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(cu_ptr + mid) // BLOCK_Q + mid
        go = first <= pid
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid - 1)
    s = lo
    q_start = tl.load(cu_ptr + s)
    n = tl.load(cu_ptr + s + 1) - q_start
    seq_len = tl.load(lens_ptr + s)
    q_lo = (pid - (q_start // BLOCK_Q + s)) * BLOCK_Q  # first query index (within the sequence) of this tile

    r = tl.arange(0, BLOCK_M)
    qi = q_lo + r // G
    head = kvh * G + r % G
    row_ok = (r < BLOCK_Q * G) & (qi < n)
    q_pos = seq_len - n + qi  # the rows' positions in the sequence
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q_rows = (q_start + qi).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q = q.to(kc_ptr.dtype.element_ty)

    # Keys this tile can see: [kv_lo, kv_hi); nothing when the tile has no rows.
    kv_hi = seq_len - n + tl.minimum(q_lo + BLOCK_Q, n)
    kv_hi = tl.where(q_lo < n, kv_hi, 0)
    kv_lo = kv_hi * 0
    if USE_WINDOW:
        kv_lo = tl.maximum(seq_len - n + q_lo - window + 1, 0)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite start: no inf - inf for fully masked rows
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = bt_ptr + s.to(tl.int64) * stride_bt
    for start in range(kv_lo, kv_hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        k_ok = kpos < kv_hi
        blk = tl.load(bt_row + kpos // block_size, mask=k_ok, other=0).to(tl.int64)
        base = blk * stride_cb + kvh * stride_ch + (kpos % block_size) * stride_ct
        k = tl.load(kc_ptr + base[None, :] + d[:, None], mask=k_ok[None, :] & d_ok[:, None], other=0.0)
        if FP32_DOT:
            scores = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            scores = tl.dot(q, k)
        scores = scores * qk_scale  # log2 domain: scale * log2(e)
        if SOFTCAP:  # c tanh(s / c) on base-2 scores (cap2 = c log2(e)); tanh(u) = 1 - 2 / (exp(2u) + 1)
            scores = cap2 * (1.0 - 2.0 / (tl.exp2(scores / cap2 * 2.8853900817779268) + 1.0))  # 2 log2(e)
        seen = k_ok[None, :] & (kpos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            seen = seen & (q_pos[:, None] - kpos[None, :] < window)
        scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vc_ptr + base[:, None] + d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        if FP32_DOT:  # P rounded to the cache dtype first, as the native dot sees it
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@varying("stride_bt", "num_parts")
def _decode_body(q_ptr, kc_ptr, vc_ptr, out_ptr, part_m_ptr, part_l_ptr, part_o_ptr, bt_ptr, cu_ptr, lens_ptr,
                 stride_qt, stride_qh, stride_ot, stride_oh,
                 stride_cb, stride_ch, stride_ct, stride_bt,
                 num_heads, num_parts, head_dim, block_size, qk_scale, window, partition_size, cap2,
                 G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 USE_WINDOW: tl.constexpr, SPLIT: tl.constexpr, FP32_DOT: tl.constexpr, SOFTCAP: tl.constexpr):
    """Program (sequence, kv head, partition): the G query heads of one decode row against one partition
    of the context. SPLIT: store the partial (max, sum, normalised output) for _reduce_body, else the
    output."""
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    q_row = tl.load(cu_ptr + s)
    is_decode = tl.load(cu_ptr + s + 1) - q_row == 1  # a sequence without a new token has no row
    seq_len = tl.load(lens_ptr + s)

    r = tl.arange(0, BLOCK_G)
    head = kvh * G + r
    row_ok = r < tl.where(is_decode, G, 0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(q_ptr + q_row.to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q = q.to(kc_ptr.dtype.element_ty)

    kv_lo = part * partition_size
    kv_hi = tl.minimum(kv_lo + partition_size, seq_len)
    if USE_WINDOW:
        kv_lo = tl.maximum(kv_lo, seq_len - window)
    kv_hi = tl.where(is_decode, kv_hi, 0)

    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = bt_ptr + s.to(tl.int64) * stride_bt
    for start in range(kv_lo, kv_hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        k_ok = kpos < kv_hi
        blk = tl.load(bt_row + kpos // block_size, mask=k_ok, other=0).to(tl.int64)
        base = blk * stride_cb + kvh * stride_ch + (kpos % block_size) * stride_ct
        k = tl.load(kc_ptr + base[None, :] + d[:, None], mask=k_ok[None, :] & d_ok[:, None], other=0.0)
        if FP32_DOT:
            scores = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            scores = tl.dot(q, k)
        scores = scores * qk_scale
        if SOFTCAP:  # c tanh(s / c) on base-2 scores (cap2 = c log2(e)); tanh(u) = 1 - 2 / (exp(2u) + 1)
            scores = cap2 * (1.0 - 2.0 / (tl.exp2(scores / cap2 * 2.8853900817779268) + 1.0))  # 2 log2(e)
        scores = tl.where(k_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vc_ptr + base[:, None] + d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        if FP32_DOT:  # P rounded to the cache dtype first, as the native dot sees it
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty partition: l = 0, o = 0, weight 0 below
    if SPLIT:
        # The grid is sized by the block table's width, which under a CUDA graph is max_model_len's (8,192
        # tokens: 16 partitions, of which a 200-token context uses one). A sequence that fits one partition
        # has its output written here by partition 0, and _reduce_body skips it; a longer one stores a
        # partial per partition that starts before its end, the only ones _reduce_body reads.
        multi = seq_len > partition_size
        live = r < tl.where(is_decode & multi & (part * partition_size < seq_len), G, 0)
        idx = (s * num_heads + head).to(tl.int64) * num_parts + part  # [S, Hq, P]
        tl.store(part_m_ptr + idx, m_i, mask=live)
        tl.store(part_l_ptr + idx, l_i, mask=live)
        tl.store(part_o_ptr + idx[:, None] * head_dim + d[None, :], o, mask=live[:, None] & d_ok[None, :])
        whole = r < tl.where(is_decode & (seq_len <= partition_size) & (part == 0), G, 0)
        tl.store(out_ptr + q_row.to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=whole[:, None] & d_ok[None, :])
    else:
        tl.store(out_ptr + q_row.to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@varying("num_parts")
def _reduce_body(out_ptr, part_m_ptr, part_l_ptr, part_o_ptr, cu_ptr, lens_ptr,
                 stride_ot, stride_oh, num_heads, num_parts, head_dim, partition_size,
                 BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (sequence, query head): out = sum_p w_p o_p / sum_p w_p with w_p = l_p * 2^(m_p - max m), over
    the partitions that start before the sequence's end (the only ones _decode_body wrote); nothing for a
    sequence that fits one partition (_decode_body wrote its output)."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    q_row = tl.load(cu_ptr + s)
    seq_len = tl.load(lens_ptr + s)
    is_decode = (tl.load(cu_ptr + s + 1) - q_row == 1) & (seq_len > partition_size)
    p = tl.arange(0, BLOCK_P)
    p_ok = p < tl.where(is_decode, tl.minimum(num_parts, (seq_len + partition_size - 1) // partition_size), 0)
    base = (s * num_heads + h).to(tl.int64) * num_parts
    m = tl.load(part_m_ptr + base + p, mask=p_ok, other=-1.0e30)
    l = tl.load(part_l_ptr + base + p, mask=p_ok, other=0.0)
    w = l * tl.exp2(m - tl.max(m, 0))
    d = tl.arange(0, BLOCK_D)
    o = tl.load(part_o_ptr + (base + p)[:, None] * head_dim + d[None, :],
                mask=p_ok[:, None] & (d < head_dim)[None, :], other=0.0)
    total = tl.sum(w, 0)
    res = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + q_row.to(tl.int64) * stride_ot + h * stride_oh + d, res.to(out_ptr.dtype.element_ty),
             mask=d < tl.where(is_decode, head_dim, 0))


def decode_tiles(head_dim: int, partition_size: int) -> tuple[int, int, int]:
    """(BLOCK_N keys per iteration, warps, pipeline stages) of the decode kernel, measured at batch 256,
    129-256-token contexts and a CUDA graph's 8,192-token table (scripts/gpu_decode_tune.py). Llama-3-8B's shape
    (head dim 128, 4 query heads per KV head): 16 keys, one warp, no software pipelining took 131 us against
    264 us for 64 keys, 4 warps, 3 stages on an H100 (bench_results/gpu/h100/decode_tune.json), 111 against
    247 us on an H200 timed over graph replays (bench_results/gpu/h200/nov30/decode_tune.json): the kernel waits
    on its block-table gathers, and one-warp programs keep more of them in flight per SM. The bundled model's
    (head dim 64, 3 per KV head) on that H200: 32 keys, one warp, one stage 27 us against 57 us. Other head
    dims keep the earlier tiles."""
    if head_dim == 128:
        return 16, 1, 1
    if head_dim == 64 and partition_size >= 32:
        return 32, 1, 1
    return max(16, min(64 if head_dim <= 128 else 32, pow2(partition_size))), _warps(head_dim), 3


def _warps(head_dim: int) -> int:
    """Warps per program of the prefill kernel, and of the decode kernel where no tuned tiles exist."""
    return 4 if head_dim <= 128 else 8


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    """The four kernels, wrapped for triton's mode on first use (not at import: see model/triton_jit.py)."""
    return kernel_set(interpret, store_kv=_store_kv_body, prefill=_prefill_body, decode=_decode_body,
                      reduce=_reduce_body)


def _kernels_for(t: torch.Tensor) -> SimpleNamespace:
    """Kernels that can run on t's device: CPU tensors only interpreted, CUDA tensors in triton's mode."""
    return _kernels(interpret_for(t))


def _int_tensor(x: IntSeq, device: torch.device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=torch.int32).contiguous()
    return torch.tensor(list(x), dtype=torch.int32, device=device)


def _scratch(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Split-K partials: float32, uninitialised (each partition the reduce reads is written first; the tests
    fill it with NaN to prove that)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share strides, with a contiguous head_dim")


# ----------------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------------


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k[t], v[t] ([T, Hkv, D], rows may be strided) into slot slot_mapping[t]; slot -1 is skipped."""
    t, hkv, d = k.shape
    if t == 0:
        return
    _check_cache(k_cache, v_cache)
    if k.dtype != k_cache.dtype:  # cast by torch (round to nearest even), so the kernel only copies bits
        k, v = k.to(k_cache.dtype), v.to(k_cache.dtype)
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.int64).contiguous()
    kern = _kernels_for(k_cache)
    with launching(kern):
        kern.store_kv[(t,)](k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), hkv, d, k_cache.shape[2],
                            BLOCK_H=pow2(hkv), BLOCK_D=pow2(d))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: IntSeq,
                    cu_seqlens_q: IntSeq, seq_lens: IntSeq, scale: float, sliding_window: int | None = None,
                    partition_size: int | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over the paged cache; [T, Hq, D] in q's dtype.

    Every sequence must have at least one query row. A batch of decode rows only (T == number of
    sequences) takes the flash-decoding kernels, split into partitions of `partition_size` keys when the
    longest possible context (block_tables' width x block_size) exceeds it; anything else the prefill
    kernel. `sliding_window` W: each query sees its last W keys (itself included). `softcap` c > 0: scores
    become c tanh(s / c) (Gemma 2)."""
    t, hq, d = q.shape
    if t == 0:
        return torch.empty_like(q)
    _check_cache(k_cache, v_cache)
    hkv, bs = k_cache.shape[1], k_cache.shape[2]
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not split into groups over {hkv} KV heads")
    g = hq // hkv
    dev = k_cache.device
    if q.stride(-1) != 1:
        q = q.contiguous()
    if not isinstance(block_tables, torch.Tensor):
        block_tables = torch.tensor(block_tables, dtype=torch.int32)
    bt = block_tables.to(device=dev, dtype=torch.int32).contiguous()
    cu = _int_tensor(cu_seqlens_q, dev)
    lens = _int_tensor(seq_lens, dev)
    num_seqs = lens.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    kern = _kernels_for(q)
    use_window = sliding_window is not None and sliding_window > 0
    window = int(sliding_window) if use_window else 0
    # float32 caches: exact float32 products (not TF32). The interpreter multiplies bfloat16 operands as
    # their raw bits (triton 3.9), so there they are widened to float32 after the same rounding.
    fp32_dot = k_cache.dtype == torch.float32 or (kern.interpreted and k_cache.dtype == torch.bfloat16)
    qk_scale = float(scale) * _LOG2E
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0: none), got {softcap}")
    cap2 = float(softcap) * _LOG2E
    block_d = max(16, pow2(d))  # tl.dot wants every dimension >= 16 when compiled
    strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1),
               k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), bt.stride(0))
    if t == num_seqs:  # decode rows only
        part = partition_size or PARTITION_SIZE
        num_parts = triton.cdiv(bt.shape[1] * bs, part)
        block_n, warps, stages = decode_tiles(d, part)
        split = num_parts > 1
        if split:
            part_m = _scratch((num_seqs, hq, num_parts), dev)
            part_l = _scratch((num_seqs, hq, num_parts), dev)
            part_o = _scratch((num_seqs, hq, num_parts, d), dev)
        else:
            part_m = part_l = part_o = out  # unused
        with launching(kern):
            kern.decode[(num_seqs, hkv, num_parts)](
                q, k_cache, v_cache, out, part_m, part_l, part_o, bt, cu, lens, *strides,
                hq, num_parts, d, bs, qk_scale, window, part, cap2,
                G=g, BLOCK_G=max(16, pow2(g)), BLOCK_N=block_n, BLOCK_D=block_d, USE_WINDOW=use_window,
                SPLIT=split, FP32_DOT=fp32_dot, SOFTCAP=softcap > 0, num_warps=warps, num_stages=stages)
            if split:
                kern.reduce[(num_seqs, hq)](out, part_m, part_l, part_o, cu, lens, out.stride(0), out.stride(1),
                                            hq, num_parts, d, part, BLOCK_P=pow2(num_parts), BLOCK_D=block_d)
        return out
    # Rows per program: small when most sequences decode (each tile then holds one query position's G heads).
    block_m = max(16 if t < 4 * num_seqs else (64 if d <= 128 else 32), pow2(g))
    block_q = block_m // g
    block_n = 64 if d <= 64 else 32
    grid = (t // block_q + num_seqs, hkv)
    with launching(kern):
        kern.prefill[grid](q, k_cache, v_cache, out, bt, cu, lens, *strides, num_seqs, d, bs, qk_scale,
                           window, cap2, G=g, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
                           USE_WINDOW=use_window, FP32_DOT=fp32_dot, SOFTCAP=softcap > 0, num_warps=_warps(d))
    return out
