"""GGUF blocks kept packed (--quantization gguf): the file's integers read exactly, the packed layout, and the
block GEMM (csrc/qgemm.cpp) against a dequantise-then-matmul reference. Model-free: synthetic blocks."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from tdpipe.model import cpu_ops
from tdpipe.model.block_linear import BlockLinear, pack, quantize_blocks_torch, unpack_rows
from tdpipe.model.gguf_blocks import blocks_of, requantize_8bit

# where each type keeps its fp16 scale fields inside a block (the rest: quantised values, any bits valid)
FP16_FIELDS = {Q.Q8_0: 1, Q.Q4_0: 1, Q.Q4_1: 2, Q.Q5_0: 1, Q.Q4_K: 2}


def random_tensor(kind, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF data uint8 [rows, bytes per row] of random blocks with finite, modest fp16 scales."""
    block, size = GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 5e-2, (rows, cols // block, FP16_FIELDS[kind])).astype(np.float16)
    raw[..., :2 * FP16_FIELDS[kind]] = scales.view(np.uint8)
    if kind == Q.Q4_K:
        raw[..., 0:2] = scales[..., 0:1].view(np.uint8)  # d, dmin
    return raw.reshape(rows, -1)


def dense(q: np.ndarray, s: np.ndarray, m: np.ndarray) -> np.ndarray:
    return np.repeat(s, 32, 1) * q.astype(np.float32) + np.repeat(m, 32, 1)


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_0, Q.Q8_0])
def test_blocks_are_the_files_values_exactly(kind) -> None:
    raw = random_tensor(kind, 8, 512)
    q, s, m, bits = blocks_of(kind, raw, 8, 512)
    assert bits == (4 if kind in (Q.Q4_0, Q.Q4_1, Q.Q4_K) else 8) and int(q.max()) < 2 ** bits
    ref = np.asarray(dequantize(raw, kind), np.float32).reshape(8, 512)
    assert np.array_equal(dense(q, s, m), ref)  # bit for bit: no float round trip


def test_other_types_go_through_8_bits_closely() -> None:
    raw = random_tensor(Q.Q8_0, 4, 64)  # any float weights: requantised per block with min and max
    w = np.asarray(dequantize(raw, Q.Q8_0), np.float32).reshape(4, 64)
    q, s, m, bits = requantize_8bit(w)
    span = np.repeat(s, 32, 1) * 255
    assert bits == 8 and np.all(np.abs(dense(q, s, m) - w) <= span / 255 / 2 + 1e-7)


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_then_unpack_gives_the_weights(bits: int) -> None:
    kind = Q.Q4_1 if bits == 4 else Q.Q8_0
    q, s, m, _ = blocks_of(kind, random_tensor(kind, 37, 96), 37, 96)  # 37: a partial tile of 16
    packed, scales = pack(*map(torch.from_numpy, (q, s, m)), bits)
    assert packed.shape == (3, 3, 256 if bits == 4 else 512) and scales.dtype == torch.float16  # fp16 exact
    rows = torch.tensor([0, 5, 16, 36, 17])
    got = unpack_rows(packed, scales, bits, rows)
    assert torch.equal(got, torch.from_numpy(dense(q, s, m))[rows])


def linear_of(kind, n: int, k: int, bias: bool) -> BlockLinear:
    q, s, m, bits = blocks_of(kind, random_tensor(kind, n, k, seed=n), n, k)
    b = torch.randn(n) if bias else None
    return BlockLinear(*map(torch.from_numpy, (q, s, m)), bits, b)


def test_activation_blocks_kernel_and_torch_same_bits() -> None:
    k = cpu_ops.kernel()
    if k is None:
        pytest.skip("ops kernel unavailable")
    x = torch.randn(9, 320) * torch.logspace(-2, 2, 320)  # wide ranges across blocks
    x[3] = 0  # a zero row: scale 0
    for xx in (x, x.to(torch.bfloat16)):
        got, ref = k.quantize_blocks(xx.contiguous()), quantize_blocks_torch(xx)
        for a, b in zip(got, ref):
            assert torch.equal(a, b)


@pytest.mark.parametrize("kind", [Q.Q4_1, Q.Q4_K, Q.Q8_0, Q.Q5_0])
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_block_gemm_matches_dequantise_then_matmul(kind, rows: int) -> None:
    n, k = 40, 512  # 40: the last tile of 16 partial
    lin = linear_of(kind, n, k, bias=kind == Q.Q4_1)
    x = torch.randn(rows, k)
    xq, dx, _ = quantize_blocks_torch(x)
    xd = (xq.double().view(rows, -1, 32) * dx.double()[..., None]).view(rows, k)
    ref = xd @ lin.dequantized().double().t() + (lin.bias.double() if lin.bias is not None else 0)
    got = lin(x)
    assert got.dtype == torch.float32
    # float32 sums of 16 block products against float64: the summation order is all that differs
    assert (got.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert torch.allclose(lin.reference(x).double(), ref, rtol=0, atol=1e-5 * float(ref.abs().max()))
    yb = lin(x.to(torch.bfloat16))  # bf16 in and out: the activations' rounding, then the output's
    assert yb.dtype == torch.bfloat16
    assert (yb.double() - ref).abs().max() <= 2e-2 * ref.abs().max()
    # and close to the float product itself: the int8 activations' error only
    dense_ref = x.double() @ lin.dequantized().double().t() + (lin.bias.double() if lin.bias is not None else 0)
    assert (got.double() - dense_ref).abs().max() <= 2e-2 * dense_ref.abs().max()


def test_block_gemm_empty_and_3d_input() -> None:
    lin = linear_of(Q.Q4_0, 16, 64, bias=False)
    assert lin(torch.zeros(0, 64)).shape == (0, 16)
    x = torch.randn(2, 3, 64)
    assert torch.allclose(lin(x), lin(x.reshape(6, 64)).reshape(2, 3, 16))


def _same_bits_as_the_portable_loop(k) -> None:
    for kind in (Q.Q4_1, Q.Q8_0, Q.Q4_K):
        lin = linear_of(kind, 33, 256, bias=kind != Q.Q4_K)
        xb = k.quantize_blocks(torch.randn(7, 256))
        for out in (torch.float32, torch.bfloat16):
            args = (lin.packed, lin.scales, 33, lin.bits, lin.bias, out)
            assert torch.equal(k.qgemm_portable(*xb, *args), k.qgemm(*xb, *args))
        # activations at the int8 extremes: the AVX2 path's int16 pair sums at their largest
        xq = torch.full((5, 256), -127, dtype=torch.int8)
        xq[1::2] = 127
        ones = torch.ones(5, 8)
        args = (lin.packed, lin.scales, 33, lin.bits, lin.bias, torch.float32)
        assert torch.equal(k.qgemm_portable(xq, ones, ones, *args), k.qgemm(xq, ones, ones, *args))


def test_the_portable_path_gives_the_vector_paths_bits() -> None:
    """The loop a CPU without a vector path runs (compiled into every build as qgemm_portable, so no second gcc
    run) sums the same products in the same order as the VNNI or AVX2 registers: the same bits, for every tile
    and row blocking (33 channels: a pair of tiles and a lone one; 7 rows: a block of 4 and one of 3)."""
    k = cpu_ops.kernel()
    assert k is not None
    _same_bits_as_the_portable_loop(k)


def test_the_avx2_path_gives_the_portable_bits_on_any_x86_cpu() -> None:
    """The AVX2 register kernel (CPUs without VNNI: AMD Zen 1-3) is compiled only where VNNI is absent, so an
    AVX-512 machine builds it here on purpose (-DTDPIPE_NO_AVX512, -O0: ~20 s of gcc once per kernel cache)."""
    from tdpipe.config import cpu_flags
    from tdpipe.model import jit

    if "avx2" not in cpu_flags():
        pytest.skip("not an AVX2 CPU")  # the portable loop alone: the test above covers it
    k = cpu_ops.kernel()
    if not k.qgemm_path().startswith("AVX2"):
        k = jit.build("tdpipe_ops_avx2", "ops.cpp", ["-DTDPIPE_NO_AVX512", "-O0"])
        assert k is not None, "the AVX2 build of the ops kernel failed"
    assert k.qgemm_path() == "AVX2 (no AVX-512 VNNI)"
    _same_bits_as_the_portable_loop(k)
    # W8A8's rotation (csrc/int8.cpp rotate64) by its scalar loop: the vector path's bits
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(5)) * 7
    x[1, 3] = 4000.0
    q, s = k.quantize_rows(x, True)
    q_ref, s_ref = cpu_ops.kernel().quantize_rows(x, True)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    # Int8Head's row scaling (int8.cpp scale_rows_) by its scalar loop: the vector path's and torch's bits
    for dtype in (torch.bfloat16, torch.float32):
        y = (torch.randn(5, 37, generator=torch.Generator().manual_seed(6)) * 50).to(dtype)
        y[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
        sx = torch.rand(5, generator=torch.Generator().manual_seed(7))
        a, b = y.clone(), y.clone()
        k.scale_rows_(a, sx)
        cpu_ops.kernel().scale_rows_(b, sx)
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
    # the sampler's exponential race (race.cpp) by its scalar score(): the vector path's and torch's bits
    from tdpipe.sampling import race

    x = torch.randn(7, 1000, generator=torch.Generator().manual_seed(8)) * 3
    keys = torch.randint(-(1 << 63), (1 << 63) - 1, (7,), generator=torch.Generator().manual_seed(9))
    rows, temps = torch.arange(7), torch.rand(7, generator=torch.Generator().manual_seed(10)) + 0.1
    for t in (x, x.bfloat16()):
        assert torch.equal(k.race_rows(t, rows, temps, keys), race.race_reference(t, keys, rows, temps))
    # the top-p rows' normaliser (lse.cpp) by its scalar loop: the vector path's to float rounding
    top = x.amax(-1)
    for t in (x, x.bfloat16()):
        torch.testing.assert_close(k.row_lse(t, rows, temps, top), cpu_ops.kernel().row_lse(t, rows, temps, top),
                                   rtol=1e-6, atol=0)
    # the top-k / top-p candidates (topk.cpp) by its scalar pass: the vector path's
    wide = torch.randn(5, 9000, generator=torch.Generator().manual_seed(11)).bfloat16().float()
    wide[2, 40] = float("nan")
    r5, t5 = torch.tensor([4, 2, 0]), torch.tensor([0.7, 1.0, 1.3])
    for w in (wide, wide.bfloat16()):
        for a, b in zip(k.top_candidates(w, r5, t5, 64), cpu_ops.kernel().top_candidates(w, r5, t5, 64)):
            assert torch.equal(a.nan_to_num(), b.nan_to_num())
