"""What the attention tests share: the truth (dense float64 attention on contiguous tensors), the batch shapes,
the tolerances and the compiled kernel as a fixture.

Tolerances: float32 paths agree to 2e-5 (both accumulate in fp32; the truth is computed in float64).
bfloat16 outputs are rounded once from fp32, so they may differ by one bf16 ulp: atol/rtol 1.6e-2
(one ulp is 2^-7 relative; |out| <= ~3 here). The first run JIT-builds the kernel (~20-60 s, cached in
$TDPIPE_CACHE/kernels).
"""
import os

import pytest
import torch

from tdpipe.model import paged_attention as pa

TOL = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2}}


@pytest.fixture(scope="module")
def kernel():
    k = pa.load_kernel()
    if k is None:
        if os.environ.get("TDPIPE_NO_KERNEL") == "1":
            pytest.skip("TDPIPE_NO_KERNEL=1")
        pytest.fail("paged-attention kernel failed to build (set TDPIPE_NO_KERNEL=1 to skip kernel tests)")
    return k


def dense_causal(q, ks, vs, cu, lens, scale, window=0, softcap=0.0):
    """Truth in float64 from contiguous tensors: query j of sequence s sits at position len - n + j
    (and, with a window W, sees keys from its position - W + 1 on); `softcap` c: scores c * tanh(s / c)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    hq = q.shape[1]
    for s, (k, v) in enumerate(zip(ks, vs)):
        qs = q[cu[s]:cu[s + 1]].double()
        n, L = qs.shape[0], lens[s]
        g = hq // k.shape[1]
        kk, vv = k.double().repeat_interleave(g, dim=1), v.double().repeat_interleave(g, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, kk) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        mask = torch.arange(L)[None, :] > torch.arange(L - n, L)[:, None]
        if window:
            mask |= torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None] - window
        scores = scores.masked_fill(mask, float("-inf"))
        out[cu[s]:cu[s + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)
    return out


# Mixed batches: decode rows, a length-1 sequence, chunked-prefill rows with a cached prefix, and a fresh
# prefill; lengths deliberately not multiples of the block size.
DECODE = ([1, 37, 100, 16, 129], [1, 1, 1, 1, 1])
MIXED = ([1, 40, 77, 23, 64], [1, 1, 20, 23, 5])
