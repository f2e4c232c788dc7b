"""oneDNN-packed linears (model/packed_linear.py): same bits as F.linear, only bf16 CPU layers swapped."""
import torch
import torch.nn.functional as F
from torch import nn

from tdpipe.config import cpu_supports_bf16
from tdpipe.model import packed_linear as pl


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


def test_pack_linears_swaps_only_bf16_linears():
    m = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16), nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16)),
                      nn.Linear(8, 8))  # the last stays float32
    n = pl.pack_linears(m)
    if not pl.packing_available():
        assert n == 0
        return
    assert n == 2
    assert isinstance(m[0], pl.PackedLinear) and isinstance(m[1][0], pl.PackedLinear)
    assert isinstance(m[2], nn.Linear)
    assert "in_features=8, out_features=8, bias=True" in repr(m[0])


def test_environment_switch_turns_packing_off(monkeypatch):
    monkeypatch.setenv("TDPIPE_PACKED_LINEAR", "0")
    pl.packing_available.cache_clear()
    try:
        m = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16))
        assert pl.pack_linears(m) == 0 and isinstance(m[0], nn.Linear)
    finally:
        monkeypatch.delenv("TDPIPE_PACKED_LINEAR")
        pl.packing_available.cache_clear()
