"""Every GGUF tensor type gguf-py can dequantise converts, through the one generic path.

One small GGUF per type: where gguf-py can quantise the type, random weights quantised with it; where it
cannot (the K and IQ families, NVFP4), random blocks (bytes below 0x3C, so every fp16 / e8m0 / fp8 scale
in them is finite). The converted tensor must be gguf-py's dequantisation of those bytes, in HF's
(out_features, in_features) order, and where transformers' independent torch dequantiser knows the type,
its values too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf import quants

from tdpipe.model.gguf import gguf_to_hf

QUANTISABLE = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "TQ1_0", "TQ2_0", "MXFP4"]
READ_ONLY = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S",
             "IQ3_XXS",
             "IQ3_S", "IQ4_NL", "IQ4_XS", "NVFP4"]
ROWS, COLS = 3, 256  # 256: a whole block of every type


def _write(path: Path, qtype: GGMLQuantizationType, data: np.ndarray) -> None:
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(32)
    w.add_embedding_length(COLS)
    w.add_feed_forward_length(ROWS)
    w.add_head_count(2)
    w.add_layer_norm_rms_eps(1e-6)
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        w.add_tensor("blk.0.ffn_up.weight", data)
    else:  # raw blocks: (rows, bytes per row) of uint8, the shape in elements follows from the type
        w.add_tensor("blk.0.ffn_up.weight", data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _convert(path: Path) -> torch.Tensor:
    _, it = gguf_to_hf(path)
    (name, w), = list(it)
    assert name == "model.layers.0.mlp.up_proj.weight"
    return w


def test_the_lists_cover_what_gguf_py_dequantises() -> None:
    """A gguf-py upgrade that reads a new type fails here until the type is added to a list above."""
    readable = set()
    x = np.zeros((1, COLS), np.float32)
    for t in GGMLQuantizationType:
        block, size = GGML_QUANT_SIZES[t]
        if COLS % block:
            continue
        try:
            quants.dequantize(np.zeros((1, COLS // block * size), np.uint8), t)
            readable.add(t.name)
        except NotImplementedError:
            pass
    assert readable == set(QUANTISABLE + READ_ONLY)
    assert quants.quantize(x, GGMLQuantizationType.Q8_0).dtype == np.uint8


@pytest.mark.parametrize("name", QUANTISABLE)
def test_quantised_weights_convert(name: str, tmp_path: Path) -> None:
    qtype = GGMLQuantizationType[name]
    x = np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(np.float32)
    data = quants.quantize(x, qtype)
    _write(tmp_path / f"{name}.gguf", qtype, data)
    got = _convert(tmp_path / f"{name}.gguf")
    want = torch.from_numpy(np.asarray(quants.dequantize(data, qtype), np.float32))
    assert got.shape == (ROWS, COLS) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # and the round trip lands near the weights (ternary types only keep the signs' pattern)
    if not name.startswith("TQ"):
        assert torch.corrcoef(torch.stack([got.flatten(), torch.from_numpy(x).flatten()]))[0, 1] > 0.9


@pytest.mark.parametrize("name", READ_ONLY)
def test_read_only_types_convert(name: str, tmp_path: Path) -> None:
    from transformers.integrations.gguf import dequant as hf_dequant

    qtype = GGMLQuantizationType[name]
    block, size = GGML_QUANT_SIZES[qtype]
    data = np.random.default_rng(1).integers(0, 0x3C, (ROWS, COLS // block * size), dtype=np.uint8)
    _write(tmp_path / f"{name}.gguf", qtype, data)
    got = _convert(tmp_path / f"{name}.gguf")
    want = torch.from_numpy(np.asarray(quants.dequantize(data, qtype), np.float32))
    assert got.shape == (ROWS, COLS) and torch.isfinite(got).all() and got.abs().sum() > 0
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    if int(qtype) in hf_dequant.GGML_BLOCK:  # a second, independent implementation
        theirs = hf_dequant.dequantize(torch.from_numpy(data.reshape(-1)), int(qtype)).reshape(ROWS, COLS)
        torch.testing.assert_close(got, theirs, rtol=1e-6, atol=1e-6)


def test_f64_and_unreadable_types(tmp_path: Path) -> None:
    """F64 is read (gguf-py's dequantize stops at F32/F16 for plain floats); a type nothing can read is
    one line naming the tensor and the type."""
    x = np.random.default_rng(2).standard_normal((ROWS, COLS))
    w = GGUFWriter(str(tmp_path / "f64.gguf"), "llama")
    for k, v in {"block_count": 1, "context_length": 32, "embedding_length": COLS,
                 "feed_forward_length": ROWS,
                 "head_count": 2}.items():
        getattr(w, f"add_{k}")(v)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tensor("blk.0.ffn_up.weight", x)  # float64
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    torch.testing.assert_close(_convert(tmp_path / "f64.gguf"), torch.from_numpy(x.astype(np.float32)))

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_K]
    _write(tmp_path / "q8k.gguf", GGMLQuantizationType.Q8_K, np.zeros((ROWS, COLS // block * size), np.uint8))
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_up\.weight' \(type Q8_K\) cannot be dequantised"):
        _convert(tmp_path / "q8k.gguf")
