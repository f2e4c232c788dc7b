"""bf16 linears widened to float32 a slice of rows at a time (model/upcast_linear.py), for CPUs without bf16
instructions: float32 arithmetic on the bf16 weight, one rounding to bf16, the weight not copied."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tdpipe.model import packed_linear as pl
from tdpipe.model import upcast_linear as ul


def _reference(x: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
    """What a bf16 instruction with float32 accumulation computes: exact products, float32 sums."""
    b = None if lin.bias is None else lin.bias.float()
    return F.linear(x.float(), lin.weight.float(), b)


@pytest.mark.parametrize("slice_bytes", [ul.SLICE_BYTES, 4 * 96 * 7])  # one slice; 7-row slices, a ragged last
def test_upcast_matches_float32_arithmetic_to_bf16_rounding(monkeypatch, slice_bytes):
    monkeypatch.setattr(ul, "SLICE_BYTES", slice_bytes)
    torch.manual_seed(0)
    for bias in (False, True):
        lin = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
        up = ul.UpcastLinear(lin)
        assert up.rows == (160 if slice_bytes >= 4 * 96 * 160 else 7)
        for shape in ((1, 96), (7, 96), (300, 96), (2, 3, 96)):
            x = torch.randn(*shape, dtype=torch.bfloat16)
            y = up(x)
            assert y.dtype == torch.bfloat16 and y.shape == (*shape[:-1], 160) and y.is_contiguous()
            ref = _reference(x, lin)
            # within half a bf16 step of the float32 result (plus float32 summation-order noise)
            assert torch.all((y.float() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-5)
        x = torch.randn(5, 200, dtype=torch.bfloat16)[:, 10:106]  # a non-contiguous input
        assert torch.equal(up(x), up(x.contiguous()))


def test_upcast_is_closer_to_exact_than_a_bf16_sum_would_be():
    """The point of float32 arithmetic: at K = 1536 a bf16-rounded accumulation drifts; ours stays at one
    rounding. Each row's error against float64 stays within one bf16 step of the exact value."""
    torch.manual_seed(1)
    lin = nn.Linear(1536, 64, bias=False).to(torch.bfloat16)
    x = torch.randn(16, 1536, dtype=torch.bfloat16)
    exact = F.linear(x.double(), lin.weight.double())
    err = (ul.UpcastLinear(lin)(x).double() - exact).abs()
    assert torch.all(err <= exact.abs() * 2 ** -8 + 1e-4)


def test_scratch_first_made_under_inference_mode_serves_calls_outside_it():
    """The engine runs under inference_mode, a weight update or a test outside it: one scratch serves both."""
    ul._scratch.__dict__.clear()
    lin = nn.Linear(16, 8).to(torch.bfloat16)
    up = ul.UpcastLinear(lin)
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    with torch.inference_mode():
        inside = up(x)
    assert torch.equal(up(x), inside)


def test_upcast_shares_the_weight():
    """A tied lm_head keeps pointing at the embedding's bf16 tensor: no float32 copy is held."""
    emb = nn.Embedding(50, 32).to(torch.bfloat16)
    head = nn.Linear(32, 50, bias=False).to(torch.bfloat16)
    head.weight = emb.weight
    up = ul.UpcastLinear(head)
    assert up.weight is emb.weight and up.weight.dtype == torch.bfloat16
    assert "rows_per_slice=50" in repr(up)


def test_pack_linears_widens_bf16_only_where_the_cpu_lacks_bf16(monkeypatch):
    """bf16 on a CPU without bf16 instructions and without oneDNN's bf16 packing: UpcastLinear; float32 and
    float16 layers as before. With bf16 instructions (or the A/B switch) nothing is widened."""
    monkeypatch.setattr(pl, "packing_available", lambda dtype=torch.bfloat16: dtype == torch.float32)
    for has_bf16, switch, want in ((False, "1", True), (True, "1", False), (False, "0", False)):
        monkeypatch.setattr(pl, "cpu_supports_bf16", lambda: has_bf16)
        monkeypatch.setenv("TDPIPE_PACKED_LINEAR", switch)
        m = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16), nn.Linear(8, 8).to(torch.float16))
        pl.pack_linears(m)
        assert isinstance(m[0], ul.UpcastLinear) == want and type(m[1]) is nn.Linear
        assert ("bfloat16-upcast" in pl.packed_dtypes()) == want
