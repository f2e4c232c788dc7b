"""AWQ checkpoints (model/awq.py): AutoAWQ's packing read exactly, its groups as the block GEMM's blocks, the
settings tdpipe cannot run refused by name, and the dequantising reader cut for a tensor-parallel rank."""
import json

import pytest
import torch

from tdpipe.model import awq
from tdpipe.model.block_linear import BlockLinear
from tdpipe.model.weights import ModelFileError


def test_packing_is_autoawqs_column_order():
    # AutoAWQ packs columns 8c + [0, 2, 4, 6, 1, 3, 5, 7] into nibbles 0..7 of int32 c
    row = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]], dtype=torch.uint8)
    assert int(awq.pack(row)[0, 0]) & 0xFFFFFFFF == 0x86427531
    q = torch.randint(0, 16, (6, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = awq.pack(q)
    assert packed.dtype == torch.int32 and packed.shape == (6, 5) and bool((packed < 0).any())  # sign bit used
    assert torch.equal(awq.unpack(packed), q)


@pytest.mark.parametrize("group", [64, -1])
def test_groups_become_blocks_bit_for_bit(group):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 128, generator=g)
    qweight, qzeros, scales = awq.quantize_rtn(w, group)
    spec = awq.AwqSpec(group)
    assert qweight.shape == (128, 6) and scales.dtype == torch.float16
    assert scales.shape == ((2 if group == 64 else 1), 48)
    ref = awq.dequantize(qweight, qzeros, scales, spec)
    assert (ref - w).abs().max() < (w.abs().max() / 15)  # a 4-bit round trip of w
    lin = BlockLinear(*awq.awq_blocks(qweight, qzeros, scales, spec), 4)
    assert torch.equal(lin.dequantized(), ref)  # s q + m is (q - z) d exactly
    x = torch.randn(3, 128, generator=g)
    torch.testing.assert_close(lin(x), lin.reference(x), atol=1e-3, rtol=1e-3)  # the kernel, where built


def _config(tmp_path, qc):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": qc}))
    return str(tmp_path)


def test_spec_reads_the_config_and_refuses_by_field(tmp_path):
    ok = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "GEMM", "zero_point": True}
    assert awq.awq_spec(_config(tmp_path / "a", ok)) == awq.AwqSpec(128)
    assert awq.awq_spec(None) is None and awq.awq_spec(str(tmp_path / "nothing")) is None
    assert awq.awq_spec(_config(tmp_path / "b", {"quant_method": "gptq", "bits": 4})) is None
    for i, (field, value) in enumerate([("bits", 8), ("version", "gemv"), ("zero_point", False),
                                        ("group_size", 48)]):
        with pytest.raises(ModelFileError, match=rf"quantization_config\.{field} is"):
            awq.awq_spec(_config(tmp_path / f"c{i}", ok | {field: value}))


def test_tensors_that_do_not_fit_the_group_size_are_refused():
    qweight, qzeros, scales = awq.quantize_rtn(torch.randn(16, 64), 32)
    with pytest.raises(ModelFileError, match="do not fit group_size 64"):
        awq.dequantize(qweight, qzeros, scales, awq.AwqSpec(64))  # two groups stored, one expected
    with pytest.raises(ModelFileError, match="do not fit"):
        awq.awq_blocks(qweight.float(), qzeros, scales, awq.AwqSpec(32))


def test_reader_dequantises_and_cuts_for_a_rank(tmp_path):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 64, generator=g)
    qw, qz, sc = awq.quantize_rtn(w, 32)
    name = "model.layers.0.self_attn.o_proj"
    save_file({f"{name}.qweight": qw, f"{name}.qzeros": qz, f"{name}.scales": sc,
               "model.norm.weight": torch.ones(64)}, str(tmp_path / "model.safetensors"))
    _config(tmp_path, {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True})
    full = awq.dequantize(qw, qz, sc, awq.AwqSpec(32))
    got = dict(awq.read_checkpoint(str(tmp_path)))
    assert set(got) == {f"{name}.weight", "model.norm.weight"} and torch.equal(got[f"{name}.weight"], full)
    cut = dict(awq.read_checkpoint(str(tmp_path), slicer=lambda n: (1, 32, 64) if n.endswith("o_proj.weight") else None))
    assert torch.equal(cut[f"{name}.weight"], full[:, 32:])
