"""oneDNN-packed linears (model/packed_linear.py): bf16 the same bits as F.linear, float32 within float32
rounding of it; only bf16 and float32 CPU layers swapped."""
import torch
import torch.nn.functional as F
from torch import nn

from tdpipe.config import cpu_supports_bf16
from tdpipe.model import packed_linear as pl
from tdpipe.model.upcast_linear import UpcastLinear


def test_packing_available_on_bf16_cpu():
    # the CI machine is an AVX-512 bf16 CPU: a build without the ops would silently lose the speed-up
    assert pl.packing_available() == cpu_supports_bf16()


def test_packed_matches_f_linear_bit_for_bit():
    torch.manual_seed(0)
    for bias in (False, True):
        lin = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
        ref_w = lin.weight.detach().clone()
        ref_b = None if lin.bias is None else lin.bias.detach().clone()
        packed = pl.PackedLinear(lin) if pl.packing_available() else lin
        for rows in (1, 7, 300):
            x = torch.randn(rows, 96, dtype=torch.bfloat16)
            assert torch.equal(packed(x), F.linear(x, ref_w, ref_b))
        # a non-contiguous input (a column slice) gives the same result as its contiguous copy
        x = torch.randn(5, 200, dtype=torch.bfloat16)[:, 10:106]
        assert torch.equal(packed(x), F.linear(x.contiguous(), ref_w, ref_b))


def test_float32_packed_matches_f_linear_to_rounding():
    """MKL's sgemm (F.linear) and oneDNN sum in other orders: the same numbers to float32 rounding."""
    assert pl.packing_available(torch.float32)  # oneDNN's float32 GEMM needs no bf16 instructions
    torch.manual_seed(0)
    for bias in (False, True):
        lin = nn.Linear(576, 1536, bias=bias)
        ref_w = lin.weight.detach().clone()
        ref_b = None if lin.bias is None else lin.bias.detach().clone()
        packed = pl.PackedLinear(lin)
        for rows in (1, 4, 300):
            x = torch.randn(rows, 576)
            torch.testing.assert_close(packed(x), F.linear(x, ref_w, ref_b), rtol=1e-5, atol=1e-5)


def test_pack_linears_swaps_bf16_and_float32_linears_only():
    m = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16), nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16)),
                      nn.Linear(8, 8), nn.Linear(8, 8).to(torch.float16))  # float32, then float16 (stays)
    n = pl.pack_linears(m)
    assert isinstance(m[2], pl.PackedLinear) and isinstance(m[3], nn.Linear)
    if not pl.packing_available():  # bf16 packing needs the CPU's bf16 instructions: bf16 is widened instead
        assert n == 3 and isinstance(m[0], UpcastLinear) and isinstance(m[1][0], UpcastLinear)
        return
    assert n == 3
    assert isinstance(m[0], pl.PackedLinear) and isinstance(m[1][0], pl.PackedLinear)
    assert "in_features=8, out_features=8, bias=True" in repr(m[0])


def test_environment_switch_turns_packing_off(monkeypatch):
    monkeypatch.setenv("TDPIPE_PACKED_LINEAR", "0")
    pl.packing_available.cache_clear()
    try:
        m = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16), nn.Linear(8, 8))
        assert pl.pack_linears(m) == 0 and isinstance(m[0], nn.Linear) and isinstance(m[1], nn.Linear)
    finally:
        monkeypatch.delenv("TDPIPE_PACKED_LINEAR")
        pl.packing_available.cache_clear()
