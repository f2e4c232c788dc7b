"""Paged attention: C++ kernel vs pure-torch reference vs dense causal attention on contiguous tensors (the
truth, shapes and tolerances: tests/attention_oracle.py). The first run JIT-builds the kernel (~20-60 s);
after that the file runs in a few seconds.
"""
from __future__ import annotations

import pytest
import torch

from tdpipe.model import paged_attention as pa

from attention_oracle import DECODE, MIXED, TOL, dense_causal, kernel  # noqa: F401 - kernel: a fixture


def make_batch(dtype, bs, hkv, g, d, lens, nqs, seed=0):
    """Random contiguous per-sequence K/V, stored into a paged cache through random, scattered blocks."""
    gen = torch.Generator().manual_seed(seed)
    hq = hkv * g
    nb_seq = [-(-n // bs) for n in lens]
    num_blocks = sum(nb_seq) + 7
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(nb_seq) + 2
    bt = torch.full((len(lens), max_blocks), -1, dtype=torch.int32)  # unused entries must never be read
    k_cache = torch.randn((num_blocks, hkv, bs, d), generator=gen).to(dtype)  # garbage in unused slots
    v_cache = torch.randn((num_blocks, hkv, bs, d), generator=gen).to(dtype)
    ks, vs, slots = [], [], []
    for s, n in enumerate(lens):
        blocks = [perm.pop() for _ in range(nb_seq[s])]
        bt[s, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        ks.append(torch.randn((n, hkv, d), generator=gen).to(dtype))
        vs.append(torch.randn((n, hkv, d), generator=gen).to(dtype))
        slots += [blocks[t // bs] * bs + t % bs for t in range(n)]
    pa.store_kv_ref(torch.cat(ks), torch.cat(vs), k_cache, v_cache, torch.tensor(slots))
    cu = [0]
    for n in nqs:
        cu.append(cu[-1] + n)
    q = torch.randn((cu[-1], hq, d), generator=gen).to(dtype)
    return q, k_cache, v_cache, bt, cu, ks, vs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs", [16, 8])
@pytest.mark.parametrize("g", [1, 3])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("shape", [DECODE, MIXED], ids=["decode", "mixed"])
def test_kernel_matches_reference_and_dense(kernel, dtype, bs, g, d, shape):
    lens, nqs = shape
    hkv = 2
    q, kc, vc, bt, cu, ks, vs = make_batch(dtype, bs, hkv, g, d, lens, nqs, seed=bs + g + d)
    scale = d ** -0.5
    out = kernel.paged_attention(q, kc, vc, bt, torch.tensor(cu, dtype=torch.int32),
                                 torch.tensor(lens, dtype=torch.int32), scale)
    assert out.dtype == dtype and out.shape == q.shape
    ref = pa.paged_attention_ref(q, kc, vc, bt, cu, lens, scale)
    truth = dense_causal(q, ks, vs, cu, lens, scale)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    torch.testing.assert_close(out.double(), truth, **TOL[dtype])
    torch.testing.assert_close(ref.double(), truth, **TOL[dtype])


@pytest.mark.parametrize("dtype,qdtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                          (torch.bfloat16, torch.float16)])
def test_kernel_odd_shapes(kernel, dtype, qdtype):
    """head_dim not a multiple of 32, block_size 5, GQA 4, long chunk, q dtype differing from the cache."""
    lens, nqs = [300, 9, 1, 45], [70, 9, 1, 2]
    q, kc, vc, bt, cu, ks, vs = make_batch(dtype, 5, 2, 4, 80, lens, nqs, seed=3)
    q = q.to(qdtype)
    out = pa.paged_attention(q, kc, vc, bt, cu, lens, 0.1)  # front end: lists for cu / lens
    assert out.dtype == qdtype
    truth = dense_causal(q, ks, vs, cu, lens, 0.1)
    tol = TOL[torch.float32] if dtype == qdtype == torch.float32 else TOL[torch.bfloat16]
    torch.testing.assert_close(out.double(), truth, **tol)


def test_kernel_noncontiguous_q_and_int64_tables(kernel):
    lens, nqs = [33, 18], [3, 1]
    q, kc, vc, bt, cu, ks, vs = make_batch(torch.bfloat16, 16, 3, 3, 64, lens, nqs, seed=5)
    qkv = torch.cat([q.flatten(1), torch.zeros(q.shape[0], 64, dtype=q.dtype)], dim=1)
    qv = qkv[:, : q[0].numel()].view(q.shape)  # row stride != Hq * D
    assert not qv.is_contiguous()
    out = pa.paged_attention(qv, kc, vc, bt.long(), torch.tensor(cu), torch.tensor(lens), 0.125)
    torch.testing.assert_close(out.double(), dense_causal(q, ks, vs, cu, lens, 0.125), **TOL[torch.bfloat16])


def test_kernel_rejects_bad_block_ids(kernel):
    q, kc, vc, bt, cu, _, _ = make_batch(torch.float32, 16, 1, 1, 64, [20], [1])
    bt[0, 1] = kc.shape[0]  # second block (needed for token 16..19) out of range
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.paged_attention(q, kc, vc, bt, torch.tensor(cu, dtype=torch.int32),
                               torch.tensor([20], dtype=torch.int32), 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [30, 128])  # 128 x 3 x 64: past the kernel's threshold for two threads
def test_store_kv(kernel, dtype, t):
    gen = torch.Generator().manual_seed(1)
    nb, hkv, bs, d = 20, 3, 8, 64
    kc = torch.randn((nb, hkv, bs, d), generator=gen).to(dtype)
    vc = torch.randn((nb, hkv, bs, d), generator=gen).to(dtype)
    # k / v as views of a fused projection output: strided rows, contiguous head_dim.
    qkv = torch.randn((t, (2 + 2 * hkv) * d), generator=gen).to(dtype)
    k = qkv[:, 2 * d: (2 + hkv) * d].view(t, hkv, d)
    v = qkv[:, (2 + hkv) * d:].view(t, hkv, d)
    slots = torch.randperm(nb * bs, generator=gen)[:t]
    slots[[0, 7, 29, t - 3, t - 1]] = -1  # padding rows, among them some the kernel's look-ahead reaches
    kc_ref, vc_ref = kc.clone(), vc.clone()
    kernel.store_kv(k, v, kc, vc, slots)
    pa.store_kv_ref(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    s = int(slots[3])
    assert torch.equal(kc[s // bs, :, s % bs], k[3]) and torch.equal(vc[s // bs, :, s % bs], v[3])
    # front end, and nothing written for -1 slots
    kc2, vc2 = kc_ref.clone(), vc_ref.clone()
    pa.store_kv(k[[0, 7]], v[[0, 7]], kc2, vc2, torch.tensor([-1, -1]))
    assert torch.equal(kc2, kc_ref) and torch.equal(vc2, vc_ref)


def test_store_kv_ref_bad_slot_raises(kernel):
    kc = torch.zeros((2, 1, 4, 8))
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.store_kv(torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), kc, kc.clone(), torch.tensor([8]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("g", [1, 3])
def test_prefill_attention_vs_dense(dtype, g):
    gen = torch.Generator().manual_seed(2)
    hkv, d = 2, 64
    lens = [5, 17, 5, 1, 17, 40]  # repeated lengths exercise the batched (grouped) path
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    q = torch.randn((cu[-1], hkv * g, d), generator=gen).to(dtype)
    k = torch.randn((cu[-1], hkv, d), generator=gen).to(dtype)
    v = torch.randn((cu[-1], hkv, d), generator=gen).to(dtype)
    out = pa.prefill_attention(q, k, v, torch.tensor(cu, dtype=torch.int32), d ** -0.5)
    ks = [k[cu[s]:cu[s + 1]] for s in range(len(lens))]
    vs = [v[cu[s]:cu[s + 1]] for s in range(len(lens))]
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), dense_causal(q, ks, vs, cu, lens, d ** -0.5), **TOL[dtype])


def test_reference_paths_when_kernel_disabled(monkeypatch):
    """TDPIPE_NO_KERNEL=1 makes load_kernel return None and the front end falls back to the reference."""
    from tdpipe.model import jit

    monkeypatch.setattr(jit, "_built", {})  # forget the per-process build cache (restored afterwards)
    monkeypatch.setenv("TDPIPE_NO_KERNEL", "1")
    assert pa.load_kernel() is None
    lens, nqs = [20, 3], [2, 3]
    q, kc, vc, bt, cu, ks, vs = make_batch(torch.float32, 8, 1, 2, 64, lens, nqs, seed=9)
    out = pa.paged_attention(q, kc, vc, bt, cu, lens, 0.125)
    torch.testing.assert_close(out.double(), dense_causal(q, ks, vs, cu, lens, 0.125), **TOL[torch.float32])
    kc2 = kc.clone()
    pa.store_kv(torch.ones(1, 1, 64), torch.ones(1, 1, 64), kc2, vc.clone(), torch.tensor([3]))
    assert torch.equal(kc2[0, 0, 3], torch.ones(64))


def test_fresh_prefill_dispatch_and_kernel_agrees_with_sdpa(kernel):
    """bf16 fresh prompts go through the paged kernel (model/llama.py); it must match the SDPA path."""
    lens = [5, 17, 40, 1]
    q, kc, vc, bt, cu, ks, vs = make_batch(torch.bfloat16, 16, 3, 3, 64, lens, lens, seed=4)
    assert pa.kernel_prefill(q, kc)
    assert not pa.kernel_prefill(q.float(), kc.float())  # float32 stays on SDPA (bit-exact with transformers)
    via_kernel = pa.paged_attention(q, kc, vc, bt, cu, lens, 0.125)
    via_sdpa = pa.prefill_attention(q, torch.cat(ks), torch.cat(vs), cu, 0.125)
    torch.testing.assert_close(via_kernel.double(), via_sdpa.double(), **TOL[torch.bfloat16])
    torch.testing.assert_close(via_kernel.double(), dense_causal(q, ks, vs, cu, lens, 0.125), **TOL[torch.bfloat16])


@pytest.mark.parametrize("scalar", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_front_end_routes_chunks_off_a_scalar_kernel(kernel, monkeypatch, scalar, dtype):
    """Where the kernel has no AVX-512 (its portable loops, ~2-3 GFLOP/s) the front end sends prefill chunks
    to the torch path and keeps decode rows on the kernel; either way the answer is the dense one."""
    monkeypatch.setattr(pa, "scalar_kernel", lambda kern: scalar)
    calls = []
    real = pa.paged_attention_ref
    monkeypatch.setattr(pa, "paged_attention_ref", lambda *a, **k: calls.append(k.get("seqs")) or real(*a, **k))
    lens, nqs = MIXED
    q, kc, vc, bt, cu, ks, vs = make_batch(dtype, 16, 2, 3, 64, lens, nqs, seed=11)
    out = pa.paged_attention(q, kc, vc, bt, cu, lens, 0.125)
    torch.testing.assert_close(out.double(), dense_causal(q, ks, vs, cu, lens, 0.125), **TOL[dtype])
    assert calls == ([[2, 3, 4]] if scalar else [])  # the sequences with more than one query row
    calls.clear()
    lens, nqs = DECODE
    q, kc, vc, bt, cu, ks, vs = make_batch(dtype, 16, 2, 3, 64, lens, nqs, seed=12)
    out = pa.paged_attention(q, kc, vc, bt, cu, lens, 0.125)
    torch.testing.assert_close(out.double(), dense_causal(q, ks, vs, cu, lens, 0.125), **TOL[dtype])
    assert calls == []  # decode only: the kernel alone


# ----------------------------------------------------------------------------------------------------
# sliding window: query p sees keys p-W+1 .. p
# ----------------------------------------------------------------------------------------------------


def poison_out_of_window(bt, lens, nqs, bs, window, num_blocks):
    """Overwrite the block-table entries of blocks wholly before each sequence's first window (freed by the
    cache manager): ids out of range, so reading one raises (kernel) or indexes out of bounds (reference)."""
    bt = bt.clone()
    for s, (n, nq) in enumerate(zip(lens, nqs)):
        first = max(0, n - nq - window + 1) // bs
        bt[s, :first] = torch.tensor([num_blocks + 1000, -7, 2 ** 31 - 1])[torch.arange(first) % 3]
    return bt


# decode rows far past the window, a chunk with a cached prefix longer than the window, a chunk longer than
# the window, a short fresh prompt, a decode row shorter than the window
WINDOW_BATCH = ([200, 150, 90, 7, 3, 64], [1, 20, 40, 7, 1, 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs,window,g,d", [(16, 20, 1, 64), (8, 1, 4, 128), (16, 16, 2, 256), (5, 33, 4, 128),
                                           (16, 4096, 1, 64)])  # window: a block, one key, past every length
def test_kernel_sliding_window_vs_dense(kernel, dtype, bs, window, g, d):
    lens, nqs = WINDOW_BATCH
    q, kc, vc, bt, cu, ks, vs = make_batch(dtype, bs, 2, g, d, lens, nqs, seed=bs + window + d)
    bt_whole, bt = bt, poison_out_of_window(bt, lens, nqs, bs, window, kc.shape[0])
    scale = d ** -0.5
    out = kernel.paged_attention(q, kc, vc, bt, torch.tensor(cu, dtype=torch.int32),
                                 torch.tensor(lens, dtype=torch.int32), scale, window)
    truth = dense_causal(q, ks, vs, cu, lens, scale, window)
    torch.testing.assert_close(out.double(), truth, **TOL[dtype])
    ref = pa.paged_attention_ref(q, kc, vc, bt, cu, lens, scale, sliding_window=window)  # skips them too
    torch.testing.assert_close(ref.double(), truth, **TOL[dtype])
    front = pa.paged_attention(q, kc, vc, bt, cu, lens, scale, sliding_window=window)
    if pa.scalar_kernel(kernel):  # a CPU without AVX-512: the front end sends prefill chunks to the torch path
        torch.testing.assert_close(front.double(), truth, **TOL[dtype])
        for s in (s for s in range(len(nqs)) if nqs[s] == 1):  # decode rows: the kernel's
            assert torch.equal(front[cu[s]:cu[s + 1]], out[cu[s]:cu[s + 1]])
    else:
        assert torch.equal(front, out)
    if window < max(lens):  # the window matters: without it the answer differs
        full = pa.paged_attention_ref(q, kc, vc, bt_whole, cu, lens, scale)
        assert not torch.allclose(full.double(), truth, **TOL[dtype])


def test_kernel_sliding_window_reads_no_block_before_it(kernel):
    """A stale id just before the window raises nothing (it is never looked up); one inside it is checked."""
    lens, nqs, bs, w = [100], [1], 16, 36  # the window starts at 64: block 4
    q, kc, vc, bt, cu, ks, vs = make_batch(torch.float32, bs, 1, 2, 64, lens, nqs, seed=1)
    cu_t, lens_t = torch.tensor(cu, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    bt[0, :4] = -1
    out = kernel.paged_attention(q, kc, vc, bt, cu_t, lens_t, 0.125, w)
    truth = dense_causal(q, ks, vs, cu, lens, 0.125, w)
    torch.testing.assert_close(out.double(), truth, **TOL[torch.float32])
    bt[0, 4] = -1
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.paged_attention(q, kc, vc, bt, cu_t, lens_t, 0.125, w)
    with pytest.raises(RuntimeError, match="out of range"):  # without the window every block is read
        kernel.paged_attention(q, kc, vc, bt, cu_t, lens_t, 0.125)


@pytest.mark.parametrize("scalar", [True, False])
def test_sliding_window_front_end_on_a_scalar_kernel(kernel, monkeypatch, scalar):
    """The scalar build's split (decode rows on the kernel, chunks on the reference) keeps the window."""
    monkeypatch.setattr(pa, "scalar_kernel", lambda kern: scalar)
    lens, nqs = WINDOW_BATCH
    q, kc, vc, bt, cu, ks, vs = make_batch(torch.bfloat16, 8, 2, 2, 64, lens, nqs, seed=21)
    bt = poison_out_of_window(bt, lens, nqs, 8, 24, kc.shape[0])
    out = pa.paged_attention(q, kc, vc, bt, cu, lens, 0.125, sliding_window=24)
    truth = dense_causal(q, ks, vs, cu, lens, 0.125, 24)
    torch.testing.assert_close(out.double(), truth, **TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 6, 17, 100])
def test_prefill_attention_sliding_window(kernel, dtype, window):
    """Fresh prompts: SDPA with a banded mask, the kernel (bf16's path) and the dense truth agree."""
    lens = [5, 17, 5, 1, 17, 40]
    q, kc, vc, bt, cu, ks, vs = make_batch(dtype, 16, 2, 2, 64, lens, lens, seed=window)
    truth = dense_causal(q, ks, vs, cu, lens, 0.125, window)
    assert pa.kernel_prefill(q, kc, sliding_window=window) == (dtype == torch.bfloat16)
    via_sdpa = pa.prefill_attention(q, torch.cat(ks), torch.cat(vs), cu, 0.125, sliding_window=window)
    via_kernel = pa.paged_attention(q, kc, vc, bt, cu, lens, 0.125, sliding_window=window)
    torch.testing.assert_close(via_sdpa.double(), truth, **TOL[dtype])
    torch.testing.assert_close(via_kernel.double(), truth, **TOL[dtype])
    plain = pa.prefill_attention(q, torch.cat(ks), torch.cat(vs), cu, 0.125)
    no_window = pa.prefill_attention(q, torch.cat(ks), torch.cat(vs), cu, 0.125, sliding_window=0)
    assert torch.equal(no_window, plain)


def test_kernel_cache_key_follows_the_source(tmp_path):
    """The build directory is keyed by the source text: an edited kernel (a new argument, say) is built
    again instead of an old .so being loaded with the new front end."""
    from tdpipe.model import jit

    src = tmp_path / "k.cpp"
    src.write_text("int f() { return 0; }\n")
    before = jit.cpu_tag(src, jit.CFLAGS)
    src.write_text("int f(int window = 0) { return window; }\n")
    assert jit.cpu_tag(src, jit.CFLAGS) != before
    assert jit.cpu_tag(src, jit.CFLAGS + ["-DX"]) != jit.cpu_tag(src, jit.CFLAGS)


# soft-capped scores (Gemma 2's attn_logit_softcapping): c * tanh(s / c) before the mask and softmax. Queries
# and keys scaled up so that scores reach the cap (plain N(0, 1) data would barely bend under c = 50).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 24])
@pytest.mark.parametrize("softcap", [3.0, 50.0])
@pytest.mark.parametrize("scalar", [True, False])
def test_softcap_kernel_reference_and_prefill_match_the_dense_truth(kernel, monkeypatch, dtype, window, softcap,
                                                                    scalar):
    monkeypatch.setattr(pa, "scalar_kernel", lambda kern: scalar)  # the scalar build's split keeps the cap
    lens, nqs = WINDOW_BATCH
    q, kc, vc, bt, cu, ks, vs = make_batch(dtype, 8, 2, 3, 64, lens, nqs, seed=int(softcap) + window)
    q = (q.float() * 6).to(dtype)
    truth = dense_causal(q, ks, vs, cu, lens, 0.5, window, softcap)
    uncapped = dense_causal(q, ks, vs, cu, lens, 0.5, window)
    assert (truth - uncapped).abs().max() > 0.05  # the cap bends these scores
    for out in (pa.paged_attention(q, kc, vc, bt, cu, lens, 0.5, sliding_window=window, softcap=softcap),
                pa.paged_attention_ref(q, kc, vc, bt, cu, lens, 0.5, sliding_window=window, softcap=softcap)):
        torch.testing.assert_close(out.double(), truth, **TOL[dtype])
    fresh = [5, 17, 30]
    q, kc, vc, bt, cu, ks, vs = make_batch(dtype, 8, 2, 3, 64, fresh, fresh, seed=3)
    q = (q.float() * 6).to(dtype)
    truth = dense_causal(q, ks, vs, cu, fresh, 0.5, window, softcap)
    out = pa.prefill_attention(q, torch.cat(ks), torch.cat(vs), cu, 0.5, sliding_window=window, softcap=softcap)
    torch.testing.assert_close(out.double(), truth, **TOL[dtype])

