"""gguf-py's GGUFReader with a cheaper slice: the same fields and tensors, built several times faster.

gguf-py builds one numpy view per element of every metadata array (a 262,144-token vocabulary such as Gemma 3's
is three arrays of that length: tokens, scores, token types, about 1.3 million views), each a slice of an
np.memmap, whose __getitem__ and __array_finalize__ run in Python for every slice: about 9 s of the Gemma 3
270M conversion here, and again when transformers reads the tokenizer from the file (it reuses this reader:
model/gguf.py). Slicing a plain ndarray over the same mapping gives views of the same bytes without those
hooks. The tensors' data stay views of the mapped file, so nothing is read before it is used.
"""
from __future__ import annotations

from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from gguf import GGUFReader


class FastGGUFReader(GGUFReader):
    """GGUFReader whose every slice (`_get`, which all of its parsing goes through) is of a plain ndarray
    view of the memory-mapped file rather than of the np.memmap itself."""

    _plain: np.ndarray | None = None

    def _get(self, offset: int, dtype: npt.DTypeLike, count: int = 1,
             override_order: None | Literal["I", "S", "<"] = None) -> npt.NDArray[Any]:
        plain = self._plain
        if plain is None or plain.base is not self.data:
            plain = self._plain = self.data.view(np.ndarray)
        count, dt = int(count), np.dtype(dtype)
        arr = plain[offset:offset + dt.itemsize * count].view(dt)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


__all__ = ["FastGGUFReader"]
