"""The attention kernel one instruction set below this CPU's (AVX-512 -> AVX2 -> portable loops), checked
against dense attention as the native build is. Each vector path is compiled only where the CPU has it, so
without this a machine with AVX-512 never compiles the AVX2 path (AMD Zen 1-3 servers), and an AVX2 one never
the portable loops. Built at -O0: ~20 s of gcc, once per kernel cache; the shapes are small."""
from __future__ import annotations

import pytest
import torch

from tdpipe.config import int8_kv_row_width
from tdpipe.model import jit
from tdpipe.model import paged_attention as pa

from attention_oracle import DECODE, MIXED, TOL, dense_causal, kernel  # noqa: F401 - kernel: a fixture
from test_int8_kv_cache import make_int8_batch
from test_paged_attention import make_batch, poison_out_of_window

DOWN = {"avx512": ("-DTDPIPE_NO_AVX512", "avx2"), "avx2": ("-DTDPIPE_NO_AVX2", "scalar")}


def isa(kern) -> str:
    """'avx512', 'avx2' or 'scalar' (kernel_info: 'avx512+bf16dot, 2 threads')."""
    return kern.kernel_info().split(",")[0].split("+")[0]


@pytest.fixture(scope="module")
def lower(kernel):
    """The kernel built one ISA down (the native one where there is none below: the portable loops)."""
    native = isa(kernel)
    if native not in DOWN:
        return kernel
    flag, want = DOWN[native]
    mod = jit.build(f"tdpipe_paged_attention_{want}", "paged_attention.cpp", [flag, "-O0"])
    if mod is None:
        pytest.fail(f"the {want} attention kernel did not build")
    assert isa(mod) == want
    return mod


def _run(kern, q, kc, vc, bt, cu, lens, scale, window=0, softcap=0.0):
    return kern.paged_attention(q, kc, vc, bt, torch.tensor(cu, dtype=torch.int32),
                                torch.tensor(lens, dtype=torch.int32), scale, window, softcap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("g,d", [(1, 64), (3, 128), (4, 80)])
@pytest.mark.parametrize("shape", [DECODE, MIXED], ids=["decode", "mixed"])
def test_lower_isa_matches_dense(lower, dtype, g, d, shape):
    lens, nqs = shape
    q, kc, vc, bt, cu, ks, vs = make_batch(dtype, 16, 2, g, d, lens, nqs, seed=g + d)
    out = _run(lower, q, kc, vc, bt, cu, lens, d ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), dense_causal(q, ks, vs, cu, lens, d ** -0.5), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 20, 33])
def test_lower_isa_sliding_window(lower, dtype, window):
    lens, nqs = [200, 150, 90, 7, 3, 64], [1, 20, 40, 7, 1, 1]
    q, kc, vc, bt, cu, ks, vs = make_batch(dtype, 16, 2, 2, 64, lens, nqs, seed=window)
    bt = poison_out_of_window(bt, lens, nqs, 16, window, kc.shape[0])
    out = _run(lower, q, kc, vc, bt, cu, lens, 0.125, window)
    torch.testing.assert_close(out.double(), dense_causal(q, ks, vs, cu, lens, 0.125, window), **TOL[dtype])


@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [DECODE, MIXED], ids=["decode", "mixed"])
def test_lower_isa_on_an_int8_cache(lower, qdtype, shape):
    lens, nqs = shape
    q, kc, vc, bt, cu, ks, vs = make_int8_batch(qdtype, 16, 2, 3, 64, lens, nqs, seed=5)
    out = _run(lower, q, kc, vc, bt, cu, lens, 0.125)
    torch.testing.assert_close(out.double(), dense_causal(q, ks, vs, cu, lens, 0.125), **TOL[qdtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lower_isa_stores_the_reference_int8_rows(lower, dtype):
    gen = torch.Generator().manual_seed(2)
    nb, hkv, bs, n, d = 6, 2, 8, 30, 64
    k, v = (torch.randn((n, hkv, d), generator=gen) * 3).to(dtype), torch.randn((n, hkv, d), generator=gen).to(dtype)
    slots = torch.randperm(nb * bs, generator=gen)[:n]
    caches = [torch.zeros((nb, hkv, bs, int8_kv_row_width(d)), dtype=torch.int8) for _ in range(4)]
    lower.store_kv(k, v, caches[0], caches[1], slots)
    pa.store_kv_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
def test_lower_isa_softcap(lower, kernel, dtype, window, int8):
    """Soft-capped scores (Gemma 2) in both builds, on float and int8 caches: queries scaled up so the cap
    of 3 bends the scores."""
    lens, nqs = [200, 150, 90, 7, 3, 64], [1, 20, 40, 7, 1, 1]
    make = (lambda: make_int8_batch(dtype, 16, 2, 2, 64, lens, nqs, seed=11)) if int8 else \
        (lambda: make_batch(dtype, 16, 2, 2, 64, lens, nqs, seed=11))
    q, kc, vc, bt, cu, ks, vs = make()
    q = (q.float() * 6).to(dtype)
    truth = dense_causal(q, ks, vs, cu, lens, 0.5, window, 3.0)
    assert (truth - dense_causal(q, ks, vs, cu, lens, 0.5, window)).abs().max() > 0.05
    for kern in (lower, kernel):
        torch.testing.assert_close(_run(kern, q, kc, vc, bt, cu, lens, 0.5, window, 3.0).double(), truth,
                                   **TOL[dtype])
