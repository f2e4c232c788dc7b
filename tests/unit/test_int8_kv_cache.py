"""The int8 KV cache (--kv-cache-dtype int8): its row format, the kernel's store and attention against the
pure-torch reference, and the configuration around it. The truth for attention is dense float64 attention on
the dequantised keys and values (the cache's loss is measured by perplexity, docs/quantization.md)."""
from __future__ import annotations

import pytest
import torch

from tdpipe.config import CacheConfig, ModelConfig, int8_kv_row_width
from tdpipe.engine_args import EngineArgs
from tdpipe.model import kv_quant
from tdpipe.model import paged_attention as pa

from attention_oracle import DECODE, MIXED, TOL, dense_causal, kernel  # noqa: F401 - kernel: a fixture

# -- the row format ------------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [64, 30, 256])
def test_rows_round_trip_within_half_a_level(d):
    x = torch.randn(7, 3, d) * torch.logspace(-3, 2, 7)[:, None, None]  # rows of very different sizes
    rows = kv_quant.quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (7, 3, int8_kv_row_width(d))
    scale = kv_quant.row_scales(rows)
    torch.testing.assert_close(scale, x.abs().amax(-1) / 127)
    err = (kv_quant.dequantize_rows(rows, d) - x).abs()
    assert bool((err <= scale[..., None] * 0.5 * (1 + 1e-5)).all())
    assert int(rows[..., :d].abs().max()) == 127  # each row's largest element is +-127
    assert bool((rows[..., d:int8_kv_row_width(d) - 4] == 0).all())  # the padding before the scale


def test_zero_row_has_zero_scale():
    rows = kv_quant.quantize_rows(torch.zeros(2, 64))
    assert bool((rows == 0).all()) and bool((kv_quant.dequantize_rows(rows) == 0).all())


def test_layout_and_bytes():
    assert kv_quant.cache_layout("auto", torch.bfloat16, 64) == (torch.bfloat16, 64)
    assert kv_quant.cache_layout("int8", torch.bfloat16, 64) == (torch.int8, 68)
    assert int8_kv_row_width(30) == 36  # 30 values padded to 32, then the scale
    mc = ModelConfig(architecture="LlamaForCausalLM", vocab_size=10, hidden_size=576, intermediate_size=8,
                     num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4,
                     rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=True, qkv_bias=False)
    assert mc.kv_bytes_per_token(2) == 2 * 30 * 3 * 64 * 2
    mc.kv_cache_dtype = "int8"
    assert mc.kv_bytes_per_token(2) == 2 * 30 * 3 * 68  # 1.88x the tokens per byte at head_dim 64


def test_config_names_the_field():
    with pytest.raises(ValueError, match="kv_cache_dtype .*fp8 caches are not built"):
        CacheConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="int4")
    assert EngineArgs.from_kwargs(kv_cache_dtype="int8").create_engine_config().cache.kv_cache_dtype == "int8"
    with pytest.raises(ValueError, match="runs on cpu only"):
        kv_quant.check_kv_cache_dtype("int8", "cuda")
    assert kv_quant.check_kv_cache_dtype("auto", "cuda") == "auto"


# -- store_kv ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 30])
def test_store_kv_kernel_writes_the_reference_bytes(kernel, dtype, d):
    gen = torch.Generator().manual_seed(1)
    nb, hkv, bs, n = 9, 2, 8, 40
    w = int8_kv_row_width(d)
    k = (torch.randn((n, hkv, d), generator=gen) * 4).to(dtype)
    v = torch.randn((n, hkv, d), generator=gen).to(dtype)
    slots = torch.randperm(nb * bs, generator=gen)[:n]
    slots[5] = -1  # padding rows are skipped
    caches = [torch.full((nb, hkv, bs, w), 7, dtype=torch.int8) for _ in range(4)]
    pa.store_kv(k, v, caches[0], caches[1], slots)
    pa.store_kv_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    s = int(slots[3])
    torch.testing.assert_close(kv_quant.dequantize_rows(caches[0][s // bs, :, s % bs], d), k[3].float(),
                               atol=float(k[3].float().abs().max()) / 254 * 1.001, rtol=0)


def test_store_kv_rejects_a_wrong_row_width(kernel):
    bad = torch.zeros((4, 1, 8, 64), dtype=torch.int8)  # 64 bytes: no room for the scale
    with pytest.raises(RuntimeError, match="head_dim padded to 4 bytes"):
        pa.store_kv(torch.ones(1, 1, 64), torch.ones(1, 1, 64), bad, bad.clone(), torch.tensor([0]))


# -- attention -----------------------------------------------------------------------------------------
def make_int8_batch(qdtype, bs, hkv, g, d, lens, nqs, seed=0):
    """Random K/V stored through store_kv into an int8 cache at scattered blocks; returns what attention
    needs and the dequantised keys and values per sequence (the truth's inputs)."""
    gen = torch.Generator().manual_seed(seed)
    nb_seq = [-(-n // bs) for n in lens]
    num_blocks = sum(nb_seq) + 5
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    bt = torch.full((len(lens), max(nb_seq) + 1), -1, dtype=torch.int32)
    w = int8_kv_row_width(d)
    kc = torch.randint(-127, 128, (num_blocks, hkv, bs, w), generator=gen, dtype=torch.int8)  # garbage
    vc = torch.randint(-127, 128, (num_blocks, hkv, bs, w), generator=gen, dtype=torch.int8)
    ks, vs, slots = [], [], []
    for s, n in enumerate(lens):
        blocks = [perm.pop() for _ in range(nb_seq[s])]
        bt[s, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        ks.append(torch.randn((n, hkv, d), generator=gen) * 2)
        vs.append(torch.randn((n, hkv, d), generator=gen))
        slots += [blocks[t // bs] * bs + t % bs for t in range(n)]
    pa.store_kv(torch.cat(ks).to(qdtype), torch.cat(vs).to(qdtype), kc, vc, torch.tensor(slots))
    deq = [kv_quant.dequantize_rows(kv_quant.quantize_rows(x.to(qdtype)), d) for x in ks + vs]
    cu = [0]
    for n in nqs:
        cu.append(cu[-1] + n)
    q = torch.randn((cu[-1], hkv * g, d), generator=gen).to(qdtype)
    return q, kc, vc, bt, cu, deq[:len(lens)], deq[len(lens):]


@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("g,d", [(1, 64), (3, 64), (4, 256), (2, 30)])
@pytest.mark.parametrize("shape", [DECODE, MIXED], ids=["decode", "mixed"])
@pytest.mark.parametrize("window", [0, 21])
def test_kernel_on_int8_cache_matches_dense_on_dequantised(kernel, qdtype, g, d, shape, window):
    lens, nqs = shape
    q, kc, vc, bt, cu, ks, vs = make_int8_batch(qdtype, 16, 2, g, d, lens, nqs, seed=d + g)
    scale = d ** -0.5
    out = pa.paged_attention(q, kc, vc, bt, cu, lens, scale, sliding_window=window)
    truth = dense_causal(q, ks, vs, cu, lens, scale, window)
    torch.testing.assert_close(out.double(), truth, **TOL[qdtype])
    ref = pa.paged_attention_ref(q, kc, vc, bt, cu, lens, scale, sliding_window=window)
    torch.testing.assert_close(ref.double(), truth, **TOL[qdtype])


def test_fresh_prompts_read_the_int8_cache(kernel):
    """A prompt's own attention reads the quantised cache (as its later decode steps do), not SDPA."""
    lens = [5, 40]
    q, kc, *_ = make_int8_batch(torch.bfloat16, 16, 1, 2, 64, lens, lens)
    assert pa.kernel_prefill(q, kc) and pa.kernel_prefill(q.float(), kc)


def test_reference_path_without_the_kernel(monkeypatch):
    from tdpipe.model import jit

    monkeypatch.setattr(jit, "_built", {})
    monkeypatch.setenv("TDPIPE_NO_KERNEL", "1")
    assert pa.load_kernel() is None
    lens, nqs = MIXED
    q, kc, vc, bt, cu, ks, vs = make_int8_batch(torch.float32, 8, 1, 3, 64, lens, nqs, seed=5)
    out = pa.paged_attention(q, kc, vc, bt, cu, lens, 0.125)
    torch.testing.assert_close(out.double(), dense_causal(q, ks, vs, cu, lens, 0.125), **TOL[torch.float32])


def test_triton_backend_refuses_an_int8_cache(monkeypatch):
    q, kc, vc, bt, cu, *_ = make_int8_batch(torch.float32, 8, 1, 1, 64, [3], [1])
    monkeypatch.setattr(pa, "_force_triton", True)
    with pytest.raises(ValueError, match="int8 KV cache"):
        pa.paged_attention(q, kc, vc, bt, cu, [3], 0.125)
    with pytest.raises(ValueError, match="int8 KV cache"):
        pa.store_kv(torch.ones(1, 1, 64), torch.ones(1, 1, 64), kc, vc, torch.tensor([0]))
