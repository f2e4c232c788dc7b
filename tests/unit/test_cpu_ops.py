"""Fused bf16 ops (csrc/ops.cpp) against the torch expressions they replace."""
import torch
import torch.nn.functional as F

from tdpipe.model import cpu_ops as ops
from tdpipe.model.layers import RotaryEmbedding


def test_kernel_builds():
    assert ops.kernel() is not None  # must fail, not skip, when the compiler or build is broken


def test_add_rms_norm_matches_transformers_formula():
    torch.manual_seed(0)
    x, r, w = torch.randn(37, 576).bfloat16(), torch.randn(37, 576).bfloat16(), torch.randn(576).bfloat16()
    ref_res = r + x
    xf = ref_res.float()
    ref = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    r2 = r.clone()
    out = ops.add_rms_norm(x, r2, w, 1e-5)
    assert torch.equal(r2, ref_res)  # the residual stream is updated in place, rounded like torch
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=4e-2)  # 1 bf16 ulp: summation order


def test_silu_and_mul():
    gu = (torch.randn(9, 2 * 1536) * 3).bfloat16()
    g, u = gu.chunk(2, -1)
    torch.testing.assert_close(ops.silu_and_mul(gu).float(), (F.silu(g) * u).float(), rtol=1e-2, atol=1e-2)


def test_rope_in_place_on_strided_view():
    rot = RotaryEmbedding(64, 512, 10000.0, None)
    qkv = torch.randn(11, 960).bfloat16()
    pos = torch.randint(0, 512, (11,))
    q = qkv[:, :576].view(11, 9, 64)  # rows strided by 960, as in the fused projection
    cs = rot.cos_sin[pos].bfloat16()
    assert rot.cos_sin.shape == (512, 64)  # cos | sin of the 32 frequencies, each used in both halves
    cos, sin = cs[:, None, :32].repeat(1, 1, 2), cs[:, None, 32:].repeat(1, 1, 2)
    ref = q * cos + torch.cat((-q[..., 32:], q[..., :32]), -1) * sin
    rot(q, pos)
    assert torch.equal(q, ref)
    assert torch.equal(qkv[:, :576].view(11, 9, 64), ref)


def test_argmax_first_index_on_ties():
    x = torch.randn(5, 1000).bfloat16()
    x[2, 10] = x[2, 700] = 40
    a = ops.argmax(x)
    assert torch.equal(a, x.argmax(-1)) and a[2] == 10


def test_mmap_threshold_pinned_on_glibc():
    """The engine and stages pin glibc's mmap threshold (tdpipe/malloc.py): without it a long sampling run
    at pp=2 fragmented the heap until the OOM killer stopped it."""
    import sys

    from tdpipe.malloc import pin_mmap_threshold

    assert pin_mmap_threshold(0) is False
    if sys.platform.startswith("linux"):
        import platform
        if platform.libc_ver()[0] == "glibc":
            assert pin_mmap_threshold(1 << 20) is True
