"""The Triton paged-attention kernels compiled on a GPU, against the pure-torch reference on the same CUDA
tensors: what tests/unit/test_triton_attention.py checks under Triton's CPU interpreter, here in compiled mode
(tensor-core dots in bfloat16 / float16, exact float32 dots, the split-K reduce). Passed on an H200 and an
H100 (docs/gpu.md), before the split-K decode stopped writing partials for short and empty partitions."""
import pytest
import torch

from tdpipe.model import paged_attention as pa

DEV = "cuda"
TOL = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 4e-3}


def batch(dtype, bs, hkv, g, d, lens, nqs, seed):
    """Random paged cache (scattered blocks, garbage in unused slots) and queries, on the GPU."""
    gen = torch.Generator().manual_seed(seed)
    nbs = [-(-n // bs) for n in lens]
    num_blocks = sum(nbs) + 5
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    bt = torch.zeros((len(lens), max(nbs) + 1), dtype=torch.int32)
    for s, nb in enumerate(nbs):
        bt[s, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
    kc = torch.randn((num_blocks, hkv, bs, d), generator=gen).to(dtype)
    vc = torch.randn((num_blocks, hkv, bs, d), generator=gen).to(dtype)
    cu = [0]
    for n in nqs:
        cu.append(cu[-1] + n)
    q = torch.randn((cu[-1], hkv * g, d), generator=gen).to(dtype)
    return (q.to(DEV), kc.to(DEV), vc.to(DEV), bt.to(DEV), torch.tensor(cu, dtype=torch.int32, device=DEV),
            torch.tensor(lens, dtype=torch.int32, device=DEV))


MIXED = ([1, 40, 77, 23, 64, 300], [1, 1, 20, 23, 5, 130])
DECODE = ([1, 37, 100, 16, 129, 2000], [1] * 6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,g,bs", [(64, 3, 16), (128, 4, 16), (256, 2, 16), (80, 7, 5)])
@pytest.mark.parametrize("shape", [MIXED, DECODE], ids=["prefill", "decode"])
def test_kernels_match_reference_on_cuda(dtype, d, g, bs, shape):
    q, kc, vc, bt, cu, lens = batch(dtype, bs, 2, g, d, *shape, seed=d + g)
    assert pa.use_triton(q)
    out = pa.paged_attention(q, kc, vc, bt, cu, lens, d ** -0.5)
    ref = pa.paged_attention_ref(q, kc, vc, bt, cu, lens, d ** -0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("window", [7, 100])
@pytest.mark.parametrize("shape", [MIXED, DECODE], ids=["prefill", "decode"])
def test_sliding_window_on_cuda(window, shape):
    q, kc, vc, bt, cu, lens = batch(torch.bfloat16, 16, 2, 3, 64, *shape, seed=1)
    out = pa.paged_attention(q, kc, vc, bt, cu, lens, 0.125, sliding_window=window)
    ref = pa.paged_attention_ref(q, kc, vc, bt, cu, lens, 0.125, sliding_window=window)
    torch.testing.assert_close(out.float(), ref.float(), atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_on_cuda(dtype):
    gen = torch.Generator().manual_seed(2)
    kc = torch.randn((9, 3, 16, 128), generator=gen).to(dtype).to(DEV)
    vc = torch.randn((9, 3, 16, 128), generator=gen).to(dtype).to(DEV)
    qkv = torch.randn((40, 8 * 128), generator=gen).to(dtype).to(DEV)
    k, v = qkv[:, 2 * 128: 5 * 128].view(40, 3, 128), qkv[:, 5 * 128:].view(40, 3, 128)
    slots = torch.randperm(9 * 16, generator=gen)[:40]
    slots[[0, 13]] = -1
    kc_ref, vc_ref = kc.clone(), vc.clone()
    pa.store_kv(k, v, kc, vc, slots.to(DEV))
    pa.store_kv_ref(k, v, kc_ref, vc_ref, slots.to(DEV))
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
