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
