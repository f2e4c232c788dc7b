"""W8A8 (model/int8_linear.py, csrc/int8.cpp): the compiled passes give the torch fallback's bits, the layer
approximates the float one, the engine wiring refuses what it cannot run."""
import pytest
import torch

from tdpipe.config import EngineConfig
from tdpipe.model import cpu_ops
from tdpipe.model import int8_linear as il
from tdpipe.model.quantization import KEEP_FLOAT, check_quantization, prepare_linears


def _torch_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    inv = torch.where(amax > 0, amax.new_full(amax.shape, il.QMAX) / amax, 0.0)
    return torch.round(xf * inv[:, None]).clamp(-il.QMAX, il.QMAX).to(torch.int8), amax / il.QMAX


@pytest.fixture(scope="module")
def kernel():
    k = cpu_ops.kernel()
    if k is None:
        pytest.fail("the int8 kernel did not build (gcc is part of the set-up)")
    return k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [576, 37, 8])  # vector body + tail, tail only
def test_kernel_quantisation_is_the_torch_expression(kernel, dtype, k):
    g = torch.Generator().manual_seed(k)
    x = (torch.randn(33, k, generator=g) * 4).to(dtype)
    x[3] = 0  # a zero row: scale 0, q 0
    x[5, : min(k, 4)] = torch.tensor([63.5, -63.5, 0.5, -0.5][: min(k, 4)])  # exact halves after scaling
    q, s = kernel.quantize_rows(x.contiguous(), False)
    rq, rs = _torch_quantize(x)
    assert torch.equal(q, rq) and torch.equal(s, rs)
    assert int(q.abs().max()) == 127 and torch.all(q[3] == 0) and s[3] == 0


def _hadamard64() -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 64:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / 8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_rotation_is_the_blockwise_hadamard_and_the_kernel_gives_the_fallbacks_bits(kernel, dtype):
    """quantize_rows(x, rotate): x times diag(H_64 / 8, ...) first, the butterflies of the C++ vector path and
    of the torch fallback giving the same bits (both quantised the same way), within fp32 rounding of the
    float64 matrix product; orthonormal, so a row's norm is kept."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(17, 192, generator=g) * 3).to(dtype)
    x[2, 70] = 5000.0  # one massive activation: spread over its block, the other two blocks keep their scale
    x[4] = 0
    r = il.rotate64(x.float())
    ref = (x.double().view(17, 3, 64) @ _hadamard64()).view(17, 192)
    assert torch.allclose(r.double(), ref, rtol=0, atol=1e-5 * float(ref.abs().max()))
    assert torch.allclose(r.double().norm(dim=1), x.double().norm(dim=1), rtol=1e-6)
    assert float(r[2, 64:128].abs().min()) > 5000 / 8 - 200  # the spike is in all 64 of its block
    q, s = kernel.quantize_rows(x.contiguous(), True)
    rq, rs = _torch_quantize(r)
    assert torch.equal(q, rq) and torch.equal(s, rs)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        kernel.quantize_rows(torch.ones(2, 96), True)


def test_rotated_w8a8_computes_the_linear_and_takes_a_massive_activation_better():
    """Int8Linear rotates W at load and x per call where K is a multiple of 64: y = x W^T still, and with one
    activation 1000x the rest the rotated layer's error is a fraction of the unrotated one's."""
    g = torch.Generator().manual_seed(4)
    lin = torch.nn.Linear(256, 96, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(96, 256, generator=g) * 0.1)
    x = torch.randn(8, 256, generator=g)
    x[:, 7] = 1000.0
    ref = lin(x).detach()
    rotated = il.Int8Linear(lin)
    old, il.ROTATE = il.ROTATE, 0
    try:
        plain = il.Int8Linear(lin)
    finally:
        il.ROTATE = old
    assert rotated.rotate and not plain.rotate and "inputs rotated" in repr(rotated)
    err_rot = float((rotated(x) - ref).norm() / ref.norm())
    err_plain = float((plain(x) - ref).norm() / ref.norm())
    assert err_rot < 0.02 and err_rot < err_plain / 2, (err_rot, err_plain)
    assert not il.Int8Linear(torch.nn.Linear(96, 8)).rotate  # K not a multiple of 64


@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [None, torch.bfloat16, torch.float32])
def test_kernel_dequantisation_is_the_torch_expression(kernel, out, bias):
    g = torch.Generator().manual_seed(1)
    acc = torch.randint(-(1 << 20), 1 << 20, (9, 70), generator=g, dtype=torch.int32)
    sx, sw = torch.rand(9, generator=g) / 100, torch.rand(70, generator=g) / 100
    b = None if bias is None else torch.randn(70, generator=g).to(bias)
    y = kernel.dequant_rows(acc, sx, sw, b, out)
    ref = acc.float() * sx[:, None] * sw[None, :]
    if b is not None:
        ref = ref + b.float()
    assert y.dtype == out and torch.equal(y, ref.to(out))


def test_kernel_bf16_rounding_is_torchs_on_ties_overflow_inf_and_nan(kernel):
    """The kernels' fp32 -> bf16 rounding (csrc/ops.cpp bf16_rne_bits, branch-free so that it vectorises):
    round half to even on exact ties, overflow to inf, inf kept, NaN kept a NaN, as torch's cast; driven
    through dequant_rows with unit scales, so the fp32 value is the integer itself (vector body and tail)."""
    ties = [(1 << 8) + 1, (1 << 8) + 3, (1 << 9) + 2, (1 << 9) + 6, -((1 << 8) + 1), -((1 << 8) + 3)]
    g = torch.Generator().manual_seed(2)
    acc = torch.cat([torch.tensor(ties, dtype=torch.int32),
                     torch.randint(-(1 << 30), 1 << 30, (43,), generator=g, dtype=torch.int32)]).view(1, -1)
    n = acc.shape[1]
    y = kernel.dequant_rows(acc, torch.ones(1), torch.ones(n), None, torch.bfloat16)
    assert torch.equal(y, acc.float().to(torch.bfloat16))
    assert y[0, :6].tolist() == [256.0, 260.0, 512.0, 520.0, -256.0, -260.0]  # half-way: to the even one
    sw = torch.ones(n)
    sw[:4] = torch.tensor([3.3e38, float("inf"), float("-inf"), float("nan")])  # 257 * 3.3e38 overflows
    y = kernel.dequant_rows(acc, torch.ones(1), sw, None, torch.bfloat16)
    ref = (acc.float() * sw).to(torch.bfloat16)
    assert y[0, :3].tolist() == [float("inf"), float("inf"), float("-inf")] and torch.isnan(y[0, 3])
    assert torch.equal(y[0, 4:], ref[0, 4:])


def test_the_layer_approximates_the_float_linear():
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 96, bias=True)
    x = torch.randn(2, 5, 256)
    q = il.Int8Linear(lin)
    y, ref = q(x), lin(x)
    assert y.shape == ref.shape == (2, 5, 96)
    assert ((y - ref).norm() / ref.norm()).item() < 0.02
    assert q.qweight_t.dtype == torch.int8 and q.qweight_t.shape == (256, 96)


def test_int_mm_result_is_exact_integer_arithmetic():
    g = torch.Generator().manual_seed(2)
    a = torch.randint(-127, 128, (17, 64), generator=g, dtype=torch.int8)
    b = torch.randint(-127, 128, (64, 40), generator=g, dtype=torch.int8)
    assert torch.equal(torch._int_mm(a, b), a.int() @ b.int())


@pytest.mark.parametrize("vnni", [True, False])
def test_int8_linear_without_vnni_sums_the_same_integers_in_float32(monkeypatch, vnni):
    """Without VNNI the int8 GEMM runs as float32 arithmetic on the widened int8 weight, a slice of rows at a
    time: the same int32 results as torch._int_mm (every sum here is below 2^24, where float32 is exact)."""
    from tdpipe.model import upcast_linear

    monkeypatch.setattr(il, "cpu_supports_vnni", lambda: vnni)
    monkeypatch.setattr(upcast_linear, "SLICE_BYTES", 4 * 96 * 24)  # 24 rows of W^T a slice: 11 slices, ragged
    torch.manual_seed(3)
    lin = torch.nn.Linear(256, 96, bias=True)
    q = il.Int8Linear(lin)
    assert q.float_rows == (0 if vnni else 24) and ("torch._int_mm" in repr(q)) == vnni
    g = torch.Generator().manual_seed(4)
    xq = torch.randint(-127, 128, (37, 256), generator=g, dtype=torch.int8)
    acc = q.int_mm(xq)
    assert acc.dtype == torch.int32 and torch.equal(acc, xq.int() @ q.qweight_t.int())
    x = torch.randn(3, 256)
    ref = lin(x)
    assert ((q(x) - ref).norm() / ref.norm()).item() < 0.02


@pytest.mark.parametrize("vnni,vector_gemm", [(True, True), (False, True), (False, False)])
def test_prepare_linears_picks_the_head(monkeypatch, vnni, vector_gemm):
    """With VNNI: Int8Head (per token, rotated, oneDNN); without, 8-bit blocks where the block GEMM has a
    vector kernel (AVX2); elsewhere (its portable loop) the head stays a float linear."""
    from tdpipe.model import block_linear, cpu_ops
    from tdpipe.model import quantization as Q
    from tdpipe.model.block_linear import BlockLinear

    monkeypatch.setattr(Q, "cpu_supports_vnni", lambda: vnni)
    monkeypatch.setattr(block_linear, "vector_block_gemm", lambda: vector_gemm and cpu_ops.kernel() is not None)
    m = torch.nn.Module()
    m.block = torch.nn.Module()
    m.block.proj = torch.nn.Linear(64, 64)
    m.lm_head = torch.nn.Linear(64, 40, bias=False)
    head = m.lm_head
    assert prepare_linears(m, "w8a8") == 1
    assert isinstance(m.block.proj, il.Int8Linear) and KEEP_FLOAT == ("lm_head",)
    x = torch.randn(9, 64)
    y, ref = m.lm_head(x), head(x)
    if vnni:
        assert isinstance(m.lm_head, il.Int8Head) and m.lm_head.per_row and m.lm_head.rotate
    elif not block_linear.vector_block_gemm():  # the head stays float (oneDNN-packed): the same numbers
        assert not isinstance(m.lm_head, (BlockLinear, il.Int8Head))
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        return
    else:
        assert isinstance(m.lm_head, BlockLinear) and m.lm_head.bits == 8
    assert (y - ref).abs().max() < 0.02 * ref.abs().max()  # 8-bit weights, 8-bit activations
    odd = torch.nn.Module()
    odd.lm_head = torch.nn.Linear(40, 16)  # K not a multiple of 32: no blocks
    prepare_linears(odd, "w8a8")
    assert not isinstance(odd.lm_head, BlockLinear)


@pytest.mark.parametrize("per_row", [True, False])
@pytest.mark.parametrize("fp32_out_broken", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_int8_head_approximates_the_float_head(dtype, fp32_out_broken, per_row, monkeypatch):
    """Where oneDNN's float32 output is wrong (an AVX2 CPU without VNNI) the head asks for bf16 and casts."""
    assert il.onednn_qlinear_available()
    if fp32_out_broken:
        monkeypatch.setattr(il, "onednn_qlinear_available", lambda out=torch.bfloat16: out == torch.bfloat16)
        assert il.onednn_head_dtype(dtype) == torch.bfloat16
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 500, bias=False)
    x = torch.nn.functional.rms_norm(torch.randn(7, 64), (64,))  # the final norm's output: unit RMS rows
    q = il.Int8Head(head, per_row=per_row)
    y, ref = q(x.to(dtype)), head(x)
    assert y.dtype == dtype and y.shape == (7, 500)
    assert ((y.float() - ref).norm() / ref.norm()).item() < 0.02
    assert (y.float().argmax(1) == ref.argmax(1)).float().mean() >= 6 / 7


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scale_rows_gives_torchs_bits(kernel, dtype):
    """Int8Head's row scaling (csrc/int8.cpp scale_rows_, vector body and scalar tail) against torch's
    y.mul_(s[:, None]): the same bits, infinities and NaNs included (a NaN stays a NaN)."""
    g = torch.Generator().manual_seed(3)
    y = (torch.randn(7, 1000, generator=g) * 100).to(dtype)  # 1000: 62 vectors and a tail of 8
    y[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3e38])
    s = torch.rand(7, generator=g) * 3
    s[2] = 1e30  # overflow to inf
    a, b = y.clone(), y.clone()
    kernel.scale_rows_(a, s)
    b.mul_(s[:, None])
    assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
    c = y.clone()
    il.scale_rows_(c, s)  # what Int8Head calls
    assert torch.equal(c.nan_to_num(), b.nan_to_num())


def test_the_int8_head_scales_each_row_and_slices_long_inputs(monkeypatch):
    """Per row, a row 1000x smaller than its neighbours keeps its resolution (one scale per call rounds it
    to nothing); past HEAD_ROWS rows oneDNN runs a slice at a time, with the same bits; a bias is added."""
    torch.manual_seed(0)
    head = torch.nn.Linear(128, 300, bias=False)
    x = torch.randn(10, 128)
    x[1::2] *= 1e-3
    ref = head(x).detach()
    per_row, per_call = il.Int8Head(head), il.Int8Head(head, per_row=False)
    err = [((q(x) - ref).norm(dim=1) / ref.norm(dim=1)) for q in (per_row, per_call)]
    assert float(err[0].max()) < 0.02 and float(err[1][1::2].min()) > 0.1
    whole = per_row(x)
    monkeypatch.setattr(il, "HEAD_ROWS", 3)
    assert torch.equal(per_row(x), whole)
    head.bias = torch.nn.Parameter(torch.randn(300))
    torch.testing.assert_close(il.Int8Head(head)(x), whole + head.bias, rtol=0, atol=1e-5)


def test_bad_quantization_names_the_field():
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="CPU only"):
        check_quantization("w8a8", "cuda")
    check_quantization("none", "cuda")


@pytest.mark.parametrize("rows,inter,spread", [(1, 96, 2.0), (33, 96, 2.0), (256, 96, 2.0), (256, 1536, 2.0),
                                               (64, 100, 300.0), (64, 1536, 300.0)])
def test_the_fused_swiglu_gives_the_unfused_layers_numbers(kernel, rows, inter, spread):
    """W8A8's one-pass SwiGLU middle (int32 -> int8 for down) against dequantise, silu_and_mul, quantise: the
    same bits, although ops.cpp is built with fast-math (a 1-ulp change of one scale moves the bundled model's
    W8A8 perplexity by ~0.3%). Shapes with and without a scalar tail; `spread` 300: activations in the
    hundreds, as the bundled model's massive ones."""
    g = torch.Generator().manual_seed(rows + inter)
    gate_up, down = torch.nn.Linear(64, 2 * inter, bias=False), torch.nn.Linear(inter, 64, bias=False)
    with torch.no_grad():
        gate_up.weight.copy_(torch.randn(2 * inter, 64, generator=g) * 0.2)
        down.weight.copy_(torch.randn(64, inter, generator=g) * 0.2)
    a, b = il.Int8Linear(gate_up), il.Int8Linear(down)
    x = (torch.randn(rows, 64, generator=g) * spread).to(torch.bfloat16)
    assert a.rotate and b.rotate == (inter % 64 == 0)  # down's input rotated (1536) and not (96, 100)
    qx, sx = il.quantize_rows(x, a.rotate)
    hq, sh = kernel.swiglu_quant(torch._int_mm(qx, a.qweight_t), sx, a.weight_scale, b.rotate)
    mid = cpu_ops.silu_and_mul(a(x))
    q, s = il.quantize_rows(mid, b.rotate)
    assert torch.equal(sh, s) and torch.equal(hq, q)
    fused, unfused = il.swiglu_w8a8(a, b, x), b(mid)
    assert fused.dtype == torch.bfloat16 and fused.shape == (rows, 64)
    assert torch.equal(fused, unfused)


def test_w8a8_gives_swiglu_mlps_the_fused_middle_and_leaves_geglu_alone():
    from types import SimpleNamespace

    from tdpipe.model.llama import MLP

    swiglu, geglu = torch.nn.Module(), torch.nn.Module()
    swiglu.mlp = MLP(SimpleNamespace(hidden_size=64, intermediate_size=96, hidden_act="silu", mlp_bias=False))
    geglu.mlp = MLP(SimpleNamespace(hidden_size=64, intermediate_size=96, hidden_act="gelu_pytorch_tanh",
                                   mlp_bias=False))
    assert prepare_linears(swiglu, "w8a8") == 2 and prepare_linears(geglu, "w8a8") == 2
    assert swiglu.mlp.fused is not None and geglu.mlp.fused is None
    x = torch.randn(5, 64).to(torch.bfloat16)
    ref = swiglu.mlp.down_proj(cpu_ops.silu_and_mul(swiglu.mlp.gate_up_proj(x)))
    torch.testing.assert_close(swiglu.mlp(x).float(), ref.float(), atol=0.02 * float(ref.abs().max()), rtol=0)


@pytest.mark.parametrize("flags,said", [({"avx2", "fma"}, True), ({"avx2", "avx512f", "avx512_vnni"}, False),
                                        ({"avx2", "avx_vnni"}, False)])
def test_w8a8_says_once_where_it_will_be_slow(monkeypatch, capsys, flags, said):
    """Without VNNI the int8 GEMMs run in float32 arithmetic, slower than a float run: said once."""
    from tdpipe import config
    from tdpipe.model import quantization

    monkeypatch.setattr(config, "cpu_flags", lambda: flags)
    quantization.w8a8_notice.cache_clear()
    try:
        line = quantization.w8a8_notice()
        quantization.w8a8_notice()
        err = capsys.readouterr().err
        assert bool(line) == said and err.count("without VNNI") == int(said)
        assert not said or "--quantization none" in line
    finally:
        quantization.w8a8_notice.cache_clear()


@pytest.mark.parametrize("rows,width", [(1, 576), (7, 576), (256, 576), (300, 64), (5, 96)])
@pytest.mark.parametrize("residual", [False, True])
def test_the_norm_hands_its_linear_the_int8_rows_it_would_have_made(kernel, rows, width, residual):
    """add_rms_norm_quant = quantize_rows(add_rms_norm(x)) bit for bit, rotated or not, with a massive
    activation in a row; the residual stream updated the same way."""
    g = torch.Generator().manual_seed(rows + width)
    x = (torch.randn(rows, width, generator=g) * 3).to(torch.bfloat16)
    x[0, 3] = 300.0
    r = torch.randn(rows, width, generator=g).to(torch.bfloat16)
    w = torch.randn(width, generator=g).to(torch.bfloat16)
    for rotate in (False, True) if width % 64 == 0 else (False,):
        r1, r2 = r.clone(), r.clone()
        q1, s1 = il.quantize_rows(kernel.add_rms_norm(x, r1 if residual else None, w, 1e-5), rotate)
        q2, s2 = kernel.add_rms_norm_quant(x, r2 if residual else None, w, 1e-5, rotate)
        assert torch.equal(q1, q2) and torch.equal(s1, s2) and torch.equal(r1, r2)


@pytest.mark.parametrize("name,fused_norms", [("qwen2.5-0.5b", 4), ("phi-3-mini-4k", 4), ("gemma-3-270m", 0)])
def test_w8a8_norms_quantise_for_their_linears_with_the_same_numbers(name, fused_norms):
    """prepare_linears("w8a8") has both pre-norms of a Llama-style layer hand int8 rows to qkv_proj and to the
    MLP (Qwen2's qkv bias, Phi-3's fused projections included), and leaves Gemma's sandwich layers and
    GemmaRMSNorm alone; the layer's projections give the same bits with the fusion as without."""
    from dataclasses import replace

    from tdpipe.config import ModelConfig
    from tdpipe.model import random_model as rm
    from tdpipe.model.llama import LlamaForCausalLM
    from tdpipe.model.quantized_rows import QuantizedRows

    cfg = ModelConfig.from_hf(rm.published_config(name))
    cfg = replace(cfg, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, end_layer=2).to(torch.bfloat16)
    prepare_linears(model, "w8a8")
    norms = [n for n in model.modules() if getattr(n, "quantize_rotate", None) is not None]
    assert len(norms) == fused_norms
    if not fused_norms:
        return
    layer = model.layers[1]
    x = torch.randn(9, 128).to(torch.bfloat16)
    res = torch.randn(9, 128).to(torch.bfloat16)
    for norm, consume in ((layer.input_layernorm, layer.self_attn.qkv_proj), (layer.post_attention_layernorm, layer.mlp)):
        r1, r2 = res.clone(), res.clone()
        rows = norm(x, r1)
        assert isinstance(rows, QuantizedRows) and rows.shape == (9, 128) and rows.dtype == torch.bfloat16
        fused = consume(rows)
        flag, norm.quantize_rotate = norm.quantize_rotate, None
        plain = consume(norm(x, r2))
        norm.quantize_rotate = flag
        assert torch.equal(fused, plain) and torch.equal(r1, r2)
