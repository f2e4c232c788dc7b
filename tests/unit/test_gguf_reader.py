"""The faster GGUF reader gives exactly what gguf-py's own reader gives: every field (name, types, element
indices, the bytes of every part) and every tensor (name, type, shape, offset, data), on the bundled GGUF
(a 49,152-token vocabulary: string, float and integer arrays, scalars)."""
from __future__ import annotations

import numpy as np
from gguf import GGUFReader

from tdpipe.model.bundled import bundled_gguf_path
from tdpipe.model.gguf import open_gguf
from tdpipe.model.gguf_reader import FastGGUFReader


def test_the_fast_reader_reads_what_gguf_py_reads():
    path = bundled_gguf_path()
    ref, fast = GGUFReader(path), open_gguf(path)
    assert isinstance(fast, FastGGUFReader)
    assert list(fast.fields) == list(ref.fields) and len(fast.fields) > 20
    vocab = fast.fields["tokenizer.ggml.tokens"]
    assert len(vocab.data) == 49152 and bytes(vocab.parts[vocab.data[5]]) == bytes(ref.fields[vocab.name].parts[vocab.data[5]])
    for name, r in ref.fields.items():
        f = fast.fields[name]
        assert (f.offset, f.types, f.data, len(f.parts)) == (r.offset, r.types, r.data, len(r.parts)), name
        assert all(a.dtype == b.dtype and a.tobytes() == b.tobytes() for a, b in zip(f.parts, r.parts)), name
        assert not any(isinstance(p, np.memmap) for p in f.parts)
    assert len(fast.tensors) == len(ref.tensors) == 272
    for f, r in zip(fast.tensors, ref.tensors):
        assert (f.name, f.tensor_type, f.shape.tolist(), f.n_elements, f.n_bytes, f.data_offset) == \
            (r.name, r.tensor_type, r.shape.tolist(), r.n_elements, r.n_bytes, r.data_offset)
        assert f.data.shape == r.data.shape and np.array_equal(f.data, r.data), f.name


def test_arrays_of_every_kind_match_gguf_py(tmp_path):
    """The one-pass array path against gguf-py's recursion: strings (empty and multi-byte), integers,
    floats, bools, and a nested array (gguf-py's own path). (GGUFWriter writes no empty array.)"""
    from gguf import GGUFWriter

    path = tmp_path / "arrays.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_array("t.strings", ["", "a", "héllo", "x" * 300])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_tensor("w", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ref, fast = GGUFReader(str(path)), FastGGUFReader(str(path))
    assert list(fast.fields) == list(ref.fields)
    for name, r in ref.fields.items():
        f = fast.fields[name]
        assert (f.offset, f.types, f.data, len(f.parts)) == (r.offset, r.types, r.data, len(r.parts)), name
        assert all(a.dtype == b.dtype and a.tobytes() == b.tobytes() for a, b in zip(f.parts, r.parts)), name
        if name != "t.nested":
            assert f.contents() == r.contents(), name
    assert fast.fields["t.strings"].contents() == ["", "a", "héllo", "x" * 300]
    assert np.array_equal(fast.tensors[0].data, ref.tensors[0].data)
