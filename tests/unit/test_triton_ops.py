"""The Triton element-wise kernels (model/triton_ops.py) under Triton's CPU interpreter, against the torch
ops of model/cpu_ops.py they replace on CUDA: add + RMSNorm (plain and Gemma, with and without the residual,
widths that are and are not powers of two), SiLU x mul (one and several column blocks), rotary embedding in
place on strided q / k views of a fused qkv row, partial rotary. bf16 only (the kernels' one dtype).

The kernels round to bf16 by integer arithmetic on the float32 bits, so the interpreter (which truncates a
plain cast) rounds as compiled code and torch do: rotary and the residual stream are compared bit for bit,
the norm to one ulp (a float32 sum ordered differently), SiLU x mul to two (an exp rounded differently, then
the product). tests/gpu/test_triton_ops_cuda.py runs the same comparisons compiled."""
from __future__ import annotations

import pytest
import torch

from tdpipe.model import cpu_ops

pytestmark = pytest.mark.triton

ULP = 2 ** -7  # one bf16 ulp (relative)
DTYPES = [torch.bfloat16]


@pytest.fixture
def tops():
    from tdpipe.model import triton_ops

    return triton_ops


@pytest.fixture
def torch_ops(monkeypatch):
    """cpu_ops with its C++ kernel off: the pure-torch reference for bf16 CPU tensors too."""
    monkeypatch.setattr(cpu_ops, "_use", lambda x: False)
    return cpu_ops


def close(a: torch.Tensor, b: torch.Tensor, ulps: int = 1) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a.float(), b.float(), rtol=ulps * ULP, atol=ulps * ULP)


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 64), (7, 576), (3, 1000)])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("gemma", [False, True])
def test_add_rms_norm(tops, torch_ops, dtype, rows, n, with_residual, gemma):
    g = torch.Generator().manual_seed(rows * n)
    x = (torch.randn(rows, n, generator=g) * 3).to(dtype)
    res = torch.randn(rows, n, generator=g).to(dtype) if with_residual else None
    w = (torch.randn(n, generator=g) * 0.2 + (0 if gemma else 1)).to(torch.float32 if gemma else dtype)
    ref_fn = torch_ops.add_gemma_rms_norm if gemma else torch_ops.add_rms_norm
    ref_res = None if res is None else res.clone()
    ref = ref_fn(x.clone(), ref_res, w, 1e-6)
    got_res = None if res is None else res.clone()
    got = tops.add_rms_norm(x.clone(), got_res, w, 1e-6, gemma=gemma)
    close(got, ref)
    if res is not None:
        same(got_res, ref_res)  # the residual stream: the sum rounds once either way


def test_add_rms_norm_reads_rows_by_stride(tops, torch_ops):
    """Rows of a wider tensor (a view with a row stride): only the view's columns are read and written."""
    base = torch.randn(4, 200, dtype=torch.bfloat16)
    x = base[:, :128]
    w = torch.randn(128).to(torch.bfloat16)
    close(tops.add_rms_norm(x, None, w, 1e-5), torch_ops.add_rms_norm(x.contiguous(), None, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 100), (5, 1536)])
def test_silu_and_mul(tops, torch_ops, dtype, rows, inter):
    g = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
    # silu one ulp off (an exp rounded differently), the product up to two
    close(tops.silu_and_mul(gate_up), torch_ops.silu_and_mul(gate_up), ulps=2)


def _table(max_pos: int, rd: int) -> torch.Tensor:
    from tdpipe.model.layers import RotaryEmbedding

    return RotaryEmbedding(rd, max_pos, 10000.0, None).cos_sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,d", [(3, 1, 64), (4, 2, 128)])
def test_rope_on_strided_q_and_k_views(tops, torch_ops, dtype, heads, kv_heads, d):
    """q and k as Attention.forward makes them: views into one fused qkv row (row stride > heads x d)."""
    t = 6
    g = torch.Generator().manual_seed(d)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    positions = torch.tensor([0, 1, 5, 17, 63, 99])
    cs = _table(100, d)
    for lo, h in ((0, heads), (heads * d, kv_heads)):
        ref_qkv, got_qkv = qkv.clone(), qkv.clone()
        ref = torch_ops.rope_(ref_qkv[:, lo:lo + h * d].view(t, h, d), positions, cs)
        got = tops.rope_(got_qkv[:, lo:lo + h * d].view(t, h, d), positions, cs)
        assert got.data_ptr() == got_qkv[:, lo:].data_ptr()  # in place
        same(got_qkv, ref_qkv)  # other columns untouched too
        same(got, ref)


def test_partial_rotary_turns_only_the_rotary_dims(tops, torch_ops):
    t, h, d, rd = 4, 2, 64, 32
    x = torch.randn(t, h, d).to(torch.bfloat16)
    positions = torch.tensor([3, 0, 9, 2])
    cs = _table(16, rd)
    ref, got = x.clone(), x.clone()
    torch_ops.rope_(ref[..., :rd], positions, cs)
    tops.rope_(got[..., :rd], positions, cs)
    same(got, ref)
    assert torch.equal(got[..., rd:], x[..., rd:])


def test_empty_batches(tops):
    e = torch.empty(0, 64, dtype=torch.bfloat16)
    assert tops.add_rms_norm(e, None, torch.ones(64, dtype=torch.bfloat16), 1e-6).shape == (0, 64)
    assert tops.silu_and_mul(torch.empty(0, 128, dtype=torch.bfloat16)).shape == (0, 64)
    assert tops.rope_(torch.empty(0, 2, 64, dtype=torch.bfloat16), torch.empty(0, dtype=torch.long),
                      _table(4, 64)).shape == (0, 2, 64)


def test_cpu_tensors_never_take_the_triton_ops(tops):
    """The dispatch sends only CUDA tensors to Triton: CPU bf16 keeps the C++ kernel or torch."""
    x = torch.randn(2, 64).to(torch.bfloat16)
    assert cpu_ops._gpu(x) is None
    assert tops.supports(x) and not tops.supports(x.float()) and not tops.supports(x.half())
