"""The Triton element-wise kernels (model/triton_ops.py) compiled on CUDA against the torch ops they replace,
in bf16: rotary and the residual stream bit for bit, the norm to one ulp (a float32 sum ordered differently),
SiLU x mul to two (an exp rounded differently, then the product); the dispatch picks them for bf16 CUDA
tensors only; and the engine's bf16 greedy tokens with them equal those without, or first part at a near-tie
of the float32 transformers reference (bench/parity.py)."""
import random

import pytest
import torch

from tdpipe import LLM, SamplingParams
from tdpipe.bench.gpu_check import TINY_LLAMA
from tdpipe.bench.parity import compare, hf_logits_fn
from tdpipe.model import cpu_ops
from tdpipe.model import triton_ops as tops
from tdpipe.model.layers import RotaryEmbedding

from gpu_models import decisive_model

ULP = 2 ** -7  # one bf16 ulp (relative)


def torch_ref(monkeypatch):
    monkeypatch.setattr(cpu_ops, "_gpu", lambda x: None)


def close(a, b, ulps: int = 1):
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a.float(), b.float(), rtol=ulps * ULP, atol=ulps * ULP)


@pytest.mark.parametrize("rows,n", [(1, 576), (256, 4096), (33, 1000)])
@pytest.mark.parametrize("gemma", [False, True])
def test_add_rms_norm(monkeypatch, rows, n, gemma):
    x = (torch.randn(rows, n, device="cuda") * 3).to(torch.bfloat16)
    res = torch.randn(rows, n, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, device="cuda") * 0.2 + (0 if gemma else 1)).to(torch.float32 if gemma else torch.bfloat16)
    got_res, ref_res = res.clone(), res.clone()
    got = tops.add_rms_norm(x, got_res, w, 1e-6, gemma=gemma)
    torch_ref(monkeypatch)
    ref = (cpu_ops.add_gemma_rms_norm if gemma else cpu_ops.add_rms_norm)(x, ref_res, w, 1e-6)
    close(got, ref)
    assert torch.equal(got_res, ref_res)


@pytest.mark.parametrize("rows,inter", [(1, 1536), (256, 14336)])
def test_silu_and_mul(monkeypatch, rows, inter):
    gate_up = (torch.randn(rows, 2 * inter, device="cuda") * 4).to(torch.bfloat16)
    got = tops.silu_and_mul(gate_up)
    torch_ref(monkeypatch)
    close(got, cpu_ops.silu_and_mul(gate_up), ulps=2)  # silu one ulp off (exp), the product up to two


@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (32, 8, 128)])
def test_rope_bit_for_bit_on_qkv_views(monkeypatch, heads, kv_heads, d):
    t = 256
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, device="cuda").to(torch.bfloat16)
    positions = torch.randint(0, 4096, (t,), device="cuda")
    cs = RotaryEmbedding(d, 4096, 500000.0, None).cos_sin.to("cuda")
    got_qkv, ref_qkv = qkv.clone(), qkv.clone()
    for lo, h in ((0, heads), (heads * d, kv_heads)):
        tops.rope_(got_qkv[:, lo:lo + h * d].view(t, h, d), positions, cs)
    torch_ref(monkeypatch)
    for lo, h in ((0, heads), (heads * d, kv_heads)):
        cpu_ops.rope_(ref_qkv[:, lo:lo + h * d].view(t, h, d), positions, cs)
    assert torch.equal(got_qkv, ref_qkv)


def test_the_dispatch_takes_them_for_16_bit_cuda_tensors_only():
    assert cpu_ops._gpu(torch.ones(2, 8, device="cuda", dtype=torch.bfloat16)) is tops
    assert cpu_ops._gpu(torch.ones(2, 8, device="cuda", dtype=torch.float32)) is None
    assert cpu_ops._gpu(torch.ones(2, 8, device="cuda", dtype=torch.float16)) is None
    assert cpu_ops._gpu(torch.ones(2, 8, dtype=torch.bfloat16)) is None


def test_engine_tokens_with_and_without_the_kernels(monkeypatch, tmp_path):
    folder, hf = decisive_model(tmp_path, seed=2)  # hf: the float32 reference that judges a divergence
    rng = random.Random(2)
    prompts = [[rng.randrange(3, TINY_LLAMA["vocab_size"]) for _ in range(n)] for n in (3, 16, 17, 40, 9, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    runs = []
    for fused in (True, False):
        if not fused:
            torch_ref(monkeypatch)
        with LLM(folder, dtype="bfloat16", device="cuda", kv_cache_memory=64 << 20) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs.append([list(o.outputs[0].token_ids) for o in outs])
    verdict = compare(prompts, runs[0], runs[1], exact=False, tie_logits=hf_logits_fn(hf))
    assert verdict["passed"], verdict["rows"]
    assert verdict["identical"] >= len(prompts) // 2, verdict["rows"]
