"""Triton paged attention (model/triton_attention.py) under Triton's CPU interpreter, against float64 dense
attention: store_kv, prefill with and without a cached prefix, decode with and without split-K, GQA, head
sizes 64 / 80 / 128 / 256, block sizes 16 / 5 / 8, odd lengths and block boundaries, sliding windows,
Gemma 2's soft-capped scores, float32 / bfloat16 / float16 caches; the forced-Triton dispatch on CPU tensors
and a tiny model's logits.

The interpreter runs the kernels' code on CPU tensors (correctness only; compiled-mode numerics and speed
need a GPU); the kernels use it for CPU tensors whether or not TRITON_INTERPRET=1 is set. It multiplies
bfloat16 operands as raw bits, so there the kernels widen bfloat16 to float32 after rounding P to bfloat16
as the native dot would. Tolerances as in test_paged_attention.py.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from attention_oracle import TOL, dense_causal
from test_paged_attention import make_batch
from tdpipe.model import paged_attention as pa

pytestmark = pytest.mark.triton

TOL16 = {torch.float16: {"atol": 4e-3, "rtol": 4e-3}, **TOL}


@pytest.fixture
def ta():
    """The Triton module. CPU tensors run interpreted whichever mode triton was imported in: compiled when
    this file runs alone (or after torch._dynamo imported triton), interpreted under TRITON_INTERPRET=1
    (that mode: test_env_vars_in_a_fresh_process)."""
    from tdpipe.model import triton_attention

    return triton_attention


def check(ta, dtype, bs, hkv, g, d, lens, nqs, seed, window=None, partition_size=None):
    q, kc, vc, bt, cu, ks, vs = make_batch(dtype, bs, hkv, g, d, lens, nqs, seed=seed)
    scale = d ** -0.5
    out = ta.paged_attention(q, kc, vc, bt, torch.tensor(cu, dtype=torch.int32),
                             torch.tensor(lens, dtype=torch.int32), scale, sliding_window=window,
                             partition_size=partition_size)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), dense_causal(q, ks, vs, cu, lens, scale, window or 0), **TOL16[dtype])
    return q, kc, vc, bt, cu, out


# Fresh prompts; chunks over a cached prefix mixed with decode rows; lengths at and around block boundaries.
FRESH = ([5, 17, 40, 1], [5, 17, 40, 1])
MIXED = ([1, 40, 77, 23, 64], [1, 1, 20, 23, 5])
BOUNDARY = ([16, 17, 32, 15, 48], [16, 2, 9, 1, 33])
DECODE = [1, 37, 100, 16, 129, 64]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [FRESH, MIXED, BOUNDARY], ids=["fresh", "prefix", "boundary"])
def test_prefill(ta, dtype, shape):
    check(ta, dtype, 16, 2, 3, 64, *shape, seed=1)


@pytest.mark.parametrize("dtype,bs,hkv,g,d", [
    (torch.bfloat16, 16, 1, 2, 256),  # Gemma 3's head size
    (torch.float32, 8, 2, 4, 128),    # Llama-3-8B's head size and group
    (torch.float16, 16, 2, 7, 64),    # Qwen2.5-0.5B's group (7 query heads per KV head), fp16 cache
    (torch.float32, 5, 3, 1, 80),     # no GQA, odd block size, head size not a power of two
])
def test_prefill_shapes(ta, dtype, bs, hkv, g, d):
    check(ta, dtype, bs, hkv, g, d, *MIXED, seed=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partition_size", [None, 32, 24], ids=["one-partition", "split-32", "split-24"])
def test_decode(ta, dtype, partition_size):
    """Decode rows: one partition (the output written directly) or split-K with a reduce, with partitions
    aligned to the blocks or not."""
    check(ta, dtype, 16, 2, 3, 64, DECODE, [1] * len(DECODE), seed=3, partition_size=partition_size)


@pytest.mark.parametrize("window", [None, 20])
def test_decode_with_a_table_wider_than_every_sequence(ta, monkeypatch, window):
    """As under a CUDA graph, whose static block table is max_model_len wide: most split-K partitions lie
    past every sequence's end. They write nothing and the reduce reads none of them (the scratch starts as
    NaN, which any read would carry into the output)."""
    monkeypatch.setattr(ta, "_scratch", lambda shape, device: torch.full(shape, float("nan"), device=device))
    q, kc, vc, bt, cu, ks, vs = make_batch(torch.bfloat16, 16, 2, 3, 64, DECODE, [1] * len(DECODE), seed=6)
    wide = torch.cat([bt, torch.full((bt.shape[0], 8), -1, dtype=torch.int32)], dim=1)  # 4 partitions past all
    out = ta.paged_attention(q, kc, vc, wide, torch.tensor(cu, dtype=torch.int32),
                             torch.tensor(DECODE, dtype=torch.int32), 0.125, sliding_window=window,
                             partition_size=32)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), dense_causal(q, ks, vs, cu, DECODE, 0.125, window or 0),
                               **TOL16[torch.bfloat16])


@pytest.mark.parametrize("d,g,bs", [(256, 2, 16), (128, 4, 5)])
def test_decode_shapes(ta, d, g, bs):
    check(ta, torch.bfloat16, bs, 1, g, d, [7, 33, 80], [1, 1, 1], seed=4, partition_size=32)


@pytest.mark.parametrize("window,nqs,partition_size", [
    (7, MIXED[1], None), (20, MIXED[1], None), (7, [1] * 5, 16), (20, [1] * 5, None), (1, [1] * 5, 16)])
def test_sliding_window(ta, window, nqs, partition_size):
    """The window W: each query sees keys p-W+1 .. p. Prefill with a prefix and decode (split or not);
    the reference path agrees too (the CPU front end uses it for windows)."""
    lens = MIXED[0]
    q, kc, vc, bt, cu, out = check(ta, torch.float32, 16, 2, 3, 64, lens, nqs, seed=5, window=window,
                                   partition_size=partition_size)
    ref = pa.paged_attention(q, kc, vc, bt, cu, lens, 0.125, sliding_window=window)  # CPU: the reference
    torch.testing.assert_close(ref, out, **TOL[torch.float32])


def test_mixed_dtypes_and_strided_inputs(ta):
    """float32 queries over a bfloat16 cache (output in q's dtype), q a strided view, int64 tables."""
    lens, nqs = [33, 18, 5], [3, 1, 5]
    q, kc, vc, bt, cu, ks, vs = make_batch(torch.bfloat16, 16, 2, 2, 64, lens, nqs, seed=6)
    q = q.float()
    qv = torch.cat([q.flatten(1), torch.zeros(q.shape[0], 64)], dim=1)[:, : q[0].numel()].view(q.shape)
    assert not qv.is_contiguous()
    out = ta.paged_attention(qv, kc, vc, bt.long(), cu, lens, 0.125)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), dense_causal(q, ks, vs, cu, lens, 0.125), **TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv(ta, dtype):
    """Strided k / v (views of a fused projection), slot -1 skipped, a dtype cast on the way in."""
    gen = torch.Generator().manual_seed(7)
    nb, hkv, bs, d, t = 9, 3, 8, 64, 30
    kc = torch.randn((nb, hkv, bs, d), generator=gen).to(dtype)
    vc = torch.randn((nb, hkv, bs, d), generator=gen).to(dtype)
    qkv = torch.randn((t, (2 + 2 * hkv) * d), generator=gen)
    k = qkv[:, 2 * d: (2 + hkv) * d].view(t, hkv, d)
    v = qkv[:, (2 + hkv) * d:].view(t, hkv, d)
    slots = torch.randperm(nb * bs, generator=gen)[:t]
    slots[[0, 7, 29]] = -1
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ta.store_kv(k, v, kc, vc, slots)
    pa.store_kv_ref(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


@pytest.fixture
def backend():
    """pa.set_attention_backend, put back to "auto" (the suite's default) afterwards."""
    yield pa.set_attention_backend
    pa.set_attention_backend("auto")


def test_forced_backend_routes_cpu_tensors_through_triton(ta, monkeypatch, backend):
    """Backend "triton": store_kv, paged_attention and the fresh-prefill choice go to the Triton kernels
    on CPU tensors; "auto": the C++ / reference path as before; anything else is an error."""
    calls = []
    for name in ("store_kv", "paged_attention"):
        real = getattr(ta, name)
        monkeypatch.setattr(ta, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    lens, nqs = MIXED
    q, kc, vc, bt, cu, ks, vs = make_batch(torch.bfloat16, 16, 2, 3, 64, lens, nqs, seed=8)
    k_new, slots = torch.randn(2, 2, 64).bfloat16(), torch.tensor([-1, 3])
    backend("auto")
    assert not pa.use_triton(q)
    pa.paged_attention(q, kc, vc, bt, cu, lens, 0.125)
    pa.store_kv(k_new, k_new, kc.clone(), vc.clone(), slots)
    assert calls == []
    backend("triton")
    assert pa.use_triton(q) and pa.kernel_prefill(q, kc) and not pa.kernel_prefill(q.float(), kc.float())
    out = pa.paged_attention(q, kc, vc, bt, cu, lens, 0.125)
    torch.testing.assert_close(out.double(), dense_causal(q, ks, vs, cu, lens, 0.125), **TOL[torch.bfloat16])
    kc2 = kc.clone()
    pa.store_kv(k_new, k_new, kc2, vc.clone(), slots)
    assert torch.equal(kc2[0, :, 3], k_new[1]) and calls == ["paged_attention", "store_kv"]
    with pytest.raises(ValueError, match="TDPIPE_ATTENTION_BACKEND"):
        backend("cuda")


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_tiny_model_logits_match_the_cpu_kernel(backend, family):
    """A 2-layer model (random weights, GQA 2, head size 64, block size 16) through the engine's steps: a
    fresh prefill, a chunk over its cached prefix, two decode steps over 3 sequences. Logits through the
    Triton kernels (forced on CPU) equal those through the C++ kernel path; Llama's layer, and Gemma 2's with
    a 16-token window on its first layer and soft-capped scores."""
    from tdpipe.config import ModelConfig
    from tdpipe.model.llama import LlamaForCausalLM
    from tdpipe.step_input import StepInput
    from tdpipe.worker.model_runner import prepare_input

    hf = {"architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 96,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 2,
          "vocab_size": 97, "max_position_embeddings": 256}
    if family == "gemma2":
        hf.update(architectures=["Gemma2ForCausalLM"], query_pre_attn_scalar=64, sliding_window=16,
                  attn_logit_softcapping=2.0, final_logit_softcapping=5.0)
    cfg = ModelConfig.from_hf(hf)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    bs, tables = 16, [[3, 0], [1, 5, 2], [4, 6]]
    gen = torch.Generator().manual_seed(1)

    def step(query_lens, seq_lens, prefill):
        ids = torch.randint(1, 97, (sum(query_lens),), generator=gen).tolist()
        rows = [tables[i][: -(-n // bs)] for i, n in enumerate(seq_lens)]
        return StepInput(batch_id=0, token_ids=ids, query_lens=query_lens, seq_lens=seq_lens,
                         block_tables=rows, is_prefill=prefill)

    steps = [step([13, 20, 17], [13, 20, 17], True), step([9, 12, 1], [22, 32, 18], True),
             step([1, 1, 1], [23, 33, 19], False), step([1, 1, 1], [24, 34, 20], False)]

    def run(dtype):
        model.to(dtype)
        model.rotary.cos_sin = model.rotary.cos_sin.float()  # as ModelRunner keeps it
        cache = torch.zeros((cfg.num_layers, 2, 7, cfg.num_kv_heads, bs, cfg.head_dim), dtype=dtype)
        logits = []
        for s in steps:
            inp = prepare_input(s, bs, torch.device("cpu"))
            logits.append(model.compute_logits(model(inp.input_ids, inp.meta, cache)[inp.sample_idx]).float())
        return torch.stack(logits)

    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 5e-2)):
        backend("auto")
        cpu = run(dtype)
        backend("triton")
        tri = run(dtype)
        torch.testing.assert_close(tri, cpu, atol=tol, rtol=tol)


@pytest.mark.slow  # starts a Python process that imports torch
def test_env_vars_in_a_fresh_process():
    """$TDPIPE_ATTENTION_BACKEND sets a fresh process's backend; importing tdpipe imports no triton (~0.2 s
    that CPU users never pay), only a Triton kernel's first use does; TRITON_INTERPRET=1 set after
    `import tdpipe` is honoured (triton's library interpreted, the kernels agree with the reference)."""
    code = """
import os, sys, torch, tdpipe, tdpipe.model.llama
from tdpipe.model import paged_attention as pa
assert 'triton' not in sys.modules, 'triton imported'
assert pa.use_triton(torch.zeros(1))
os.environ['TRITON_INTERPRET'] = '1'
from test_paged_attention import make_batch
lens = [20, 33]
for nqs in ([4, 9], [1, 1]):
    q, kc, vc, bt, cu, ks, vs = make_batch(torch.float32, 16, 2, 2, 64, lens, nqs, seed=9)
    ref = pa.paged_attention_ref(q, kc, vc, bt, cu, lens, 0.125)
    torch.testing.assert_close(pa.paged_attention(q, kc, vc, bt, cu, lens, 0.125), ref)
from tdpipe.model import triton_attention
assert triton_attention.interpreted()
"""
    here = os.path.dirname(__file__)  # test_paged_attention, and tests/ for its attention_oracle
    env = {**os.environ, "TDPIPE_ATTENTION_BACKEND": "triton",
           "PYTHONPATH": os.pathsep.join([here, os.path.dirname(here)])}
    env.pop("TRITON_INTERPRET", None)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=env)


def test_step_varying_arguments_compile_generically(ta):
    """A batch's sequence count and its block table's width change every step; compiled Triton would build
    a kernel per (== 1, divisible by 16, other) combination of them, mid-run. The compiled kernels leave them
    unspecialised (construction only: no GPU needed)."""
    kern = ta._kernels(False)
    names = {k: {kern_arg if isinstance(kern_arg, str) else getattr(kern, k).arg_names[kern_arg]
                 for kern_arg in getattr(kern, k).do_not_specialize} for k in ("prefill", "decode", "reduce")}
    assert names == {"prefill": {"num_seqs", "stride_bt"}, "decode": {"stride_bt", "num_parts"},
                     "reduce": {"num_parts"}}


def test_decode_tiles_follow_the_gpu_tuning(ta):
    """Head dims 128 (Llama-3-8B's) and 64 (the bundled model's) take the tuned tiles
    (scripts/gpu_decode_tune.py); the others keep theirs."""
    assert ta.decode_tiles(128, 512) == (16, 1, 1)
    assert ta.decode_tiles(64, 512) == (32, 1, 1)
    assert ta.decode_tiles(80, 512) == (64, 4, 3)
    assert ta.decode_tiles(256, 512) == (32, 8, 3)
    assert ta.decode_tiles(64, 24) == (32, 4, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("nqs,partition_size", [(MIXED[1], None), ([1] * 5, None), ([1] * 5, 32)],
                         ids=["prefill", "decode", "decode-split"])
def test_softcap(ta, dtype, window, nqs, partition_size):
    """Gemma 2's c tanh(s / c) on the scores, in the prefill and both decode kernels: queries scaled up so
    that the cap of 3 bends the scores (the capped truth is far from the uncapped one)."""
    lens = MIXED[0]
    q, kc, vc, bt, cu, ks, vs = make_batch(dtype, 16, 2, 3, 64, lens, nqs, seed=7)
    q = (q.float() * 6).to(dtype)
    truth = dense_causal(q, ks, vs, cu, lens, 0.5, window or 0, 3.0)
    assert (truth - dense_causal(q, ks, vs, cu, lens, 0.5, window or 0)).abs().max() > 0.05
    out = ta.paged_attention(q, kc, vc, bt, torch.tensor(cu, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                             0.5, sliding_window=window, partition_size=partition_size, softcap=3.0)
    torch.testing.assert_close(out.double(), truth, **TOL16[dtype])
    with pytest.raises(ValueError, match="softcap must be >= 0"):
        ta.paged_attention(q, kc, vc, bt, cu, lens, 0.5, softcap=-1.0)
