"""Turn a llama.cpp GGUF file into a Hugging Face style config + float tensors.

tdpipe's model code only knows HF parameter names and HF's rotate_half rope
layout, so everything GGUF-specific (names, quantisation, llama.cpp's rope row
order, Gemma's 1 + w norms) is undone here, once, at conversion time. What each
architecture needs is one table in model/gguf_families.py; every tensor type
gguf-py can dequantise is read through its generic ``dequantize``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator, TypeVar

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file

from tdpipe.model.gguf_families import (FAMILIES, GLOBAL_NAMES, ROPE_FACTOR_TENSORS, ROPE_FREQS, Family,
                                        family_of, hf_config)
from tdpipe.model.gguf_reader import FastGGUFReader

_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_T = TypeVar("_T")


GGUF_MAGIC = b"GGUF"


def open_gguf(gguf_path: str | Path) -> GGUFReader:
    """A GGUFReader over a file checked to be whole: a missing, foreign, truncated or corrupt file is a
    ModelFileError naming the file (the reader's own errors, e.g. "cannot reshape array of size 375744",
    say neither which file nor what is wrong)."""
    from tdpipe.model.weights import MissingModelFile, ModelFileError, human_size

    path = Path(gguf_path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            magic = f.read(4)
    except FileNotFoundError:
        raise MissingModelFile(f"GGUF file not found: {path}") from None
    except OSError as e:
        raise ModelFileError(f"cannot read {path}: {e.strerror or e}") from None
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{path}: not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        reader = FastGGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - numpy/struct errors from a short or scrambled file
        msg = " ".join(str(e).split()) or type(e).__name__
        raise ModelFileError(f"{path}: truncated or corrupt GGUF file ({human_size(size)}; the reader "
                             f"failed with: {msg})") from None
    need = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if need > size:
        raise ModelFileError(f"{path}: truncated: header says {human_size(need)} of data, file has "
                             f"{human_size(size)}")
    return reader


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def hf_name(gguf_name: str, family: Family = FAMILIES["llama"]) -> str:
    """Map a GGUF tensor name to the HF parameter name of ``family``'s model."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in family.names:
        raise ValueError(f"unsupported GGUF tensor {gguf_name!r} for {family.hf_arch}")
    layer, part, kind = m.groups()
    return f"model.layers.{layer}.{family.names[part]}.{kind}"


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp rotates interleaved pairs (x0,x1),(x2,x3)..., so its converter
    reorders each head's rows from HF's half-split order [first half | second
    half] into pairs. Reading rows per head as (pair, 2) and transposing to
    (2, pair) restores HF's rotate_half order. Works for weights and biases.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _config(reader: GGUFReader) -> tuple[dict, Family]:
    meta, family = family_of(reader)
    return hf_config(meta, family), family


def _dequantize(t: Any) -> np.ndarray:
    """Any tensor type gguf-py reads, as float32 in HF's (out_features, in_features) order."""
    if t.tensor_type == GGMLQuantizationType.F64:  # gguf-py's dequantize stops at F32 / F16 for plain floats
        return np.asarray(t.data, dtype=np.float64).astype(np.float32)
    try:
        return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
    except (ValueError, NotImplementedError) as e:  # a scrambled type, a short data block, an unknown type
        raise ValueError(f"GGUF tensor {t.name!r} (type {getattr(t.tensor_type, 'name', t.tensor_type)}) "
                         f"cannot be dequantised: {' '.join(str(e).split())}") from None


def _tensors(reader: GGUFReader, cfg: dict, family: Family) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantise lazily, one tensor at a time, so peak memory stays one tensor."""
    q_heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for t in reader.tensors:
        if t.name in ROPE_FACTOR_TENSORS or t.name == ROPE_FREQS:  # rope settings: in cfg["rope_scaling"]
            continue
        name = hf_name(t.name, family)
        arr = _dequantize(t)
        # numpy dims are already HF's (out_features, in_features); GGUF's `shape` is reversed.
        w = torch.from_numpy(arr.copy() if not arr.flags.writeable else arr)
        if family.permute_qk and ".q_proj." in name:
            w = unpermute_rope_rows(w, q_heads)
        elif family.permute_qk and ".k_proj." in name:
            w = unpermute_rope_rows(w, kv_heads)
        if family.norm_offset and t.name.endswith("norm.weight"):
            w = w - family.norm_offset  # in float32, as transformers' Gemma loader does
        yield name, w.contiguous()


def gguf_to_hf(gguf_path: str | Path) -> tuple[dict, Iterator[tuple[str, torch.Tensor]]]:
    """Return an HF config dict and a lazy iterator of float32 tensors under HF names."""
    reader = open_gguf(gguf_path)
    cfg, family = _config(reader)
    return cfg, _tensors(reader, cfg, family)


def _progress(items: Iterable[_T], total: int, name: str) -> Iterable[_T]:
    """A bar over the tensors on a terminal (a conversion takes seconds to minutes, once); nothing in logs."""
    if not sys.stderr.isatty():
        return items
    from tqdm.auto import tqdm  # a transformers dependency

    return tqdm(items, total=total, desc=f"converting {name}", unit="tensor", leave=False, file=sys.stderr)


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# A chat template ends each turn with one of these (Gemma, Phi-3, ChatML, Llama 3), while the file's eos is
# often the end of the whole text; llama.cpp stops on them by their text too (llama-vocab.cpp, its EOG set).
END_OF_TURN = ("<end_of_turn>", "<|end|>", "<|im_end|>", "<|eot_id|>")


def _stop_ids(reader: GGUFReader, cfg: dict, tok: Any) -> list[int]:
    """generation_config's eos list, which tdpipe stops on: the file's eos, the end-of-turn / end-of-message
    ids it names, and for a chat model (one with a template) its end-of-turn token."""
    ids = [cfg["eos_token_id"], _field(reader, "tokenizer.ggml.eot_token_id"),
           _field(reader, "tokenizer.ggml.eom_token_id")]
    if tok.chat_template:
        vocab = tok.get_vocab()
        ids += [vocab.get(t) for t in END_OF_TURN]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


# Architectures whose configs transformers' GGUF loader refuses, though it builds their vocabularies (by the
# file's own architecture and tokenizer type): its config step is shown a family it reads. Gemma (1) as Gemma 2,
# Granite (byte-level BPE) as Llama
TOKENIZER_ARCH_ALIAS = {"gemma": "gemma2", "granite": "llama"}


class _AliasedReader:
    """A GGUF reader that reports another general.architecture (TOKENIZER_ARCH_ALIAS), for the tokenizer only."""

    def __init__(self, reader: Any, arch: str) -> None:
        from gguf import GGUFValueType
        from gguf.gguf_reader import ReaderField

        self._reader = reader
        name = "general.architecture"
        self.fields = dict(reader.fields)
        self.fields[name] = ReaderField(0, name, [np.frombuffer(arch.encode(), dtype=np.uint8)], [0],
                                        [GGUFValueType.STRING])

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._reader, attr)


def _write_tokenizer(gguf_path: Path, out: Path, cfg: dict, reader: GGUFReader | None = None) -> Any:
    """Let transformers rebuild the fast tokenizer from the GGUF vocab (every family's: SentencePiece for
    Llama / Gemma / Phi-3, byte-level BPE for Qwen), pin eos/bos, save it; returns it. `reader`: the file
    already open (else opened here), which transformers then reuses instead of parsing the metadata again (gguf-py
    takes about 8 s over Gemma 3's 262,144-string vocabulary here with its own reader, 2 s with
    model/gguf_reader.py's)."""
    import gguf as gguf_py
    from transformers import AutoTokenizer  # heavy import, only needed here

    opened = gguf_py.GGUFReader
    reader = reader if reader is not None else open_gguf(gguf_path)
    arch = _field(reader, "general.architecture")
    if arch in TOKENIZER_ARCH_ALIAS:  # a vocabulary transformers reads under another architecture's name
        reader = _AliasedReader(reader, TOKENIZER_ARCH_ALIAS[arch])
    if reader is not None:  # transformers imports GGUFReader from gguf inside load_gguf_checkpoint
        def reuse(path: Any, *args: Any, **kwargs: Any) -> GGUFReader:
            same = os.path.abspath(str(path)) == os.path.abspath(str(gguf_path))
            return reader if same and not args and not kwargs else opened(path, *args, **kwargs)

        gguf_py.GGUFReader = reuse
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    finally:
        gguf_py.GGUFReader = opened
    # Chat models stop on the GGUF eos (e.g. <|im_end|>); make the saved tokenizer agree.
    for attr in ("bos", "eos"):
        tid = cfg.get(f"{attr}_token_id")
        if tid is not None:
            setattr(tok, f"{attr}_token", tok.convert_ids_to_tokens(tid))
    tok.save_pretrained(str(out))
    if not tok.chat_template:  # a base model (Gemma 3 270M): completions only
        return tok
    # Older/newer transformers store the template in different places; make sure one exists.
    if not (out / "chat_template.jinja").exists():
        tc_path = out / "tokenizer_config.json"
        tc = json.loads(tc_path.read_text(encoding="utf-8"))
        tc.setdefault("chat_template", tok.chat_template)
        tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False), encoding="utf-8")
    return tok


def _provenance(gguf_path: Path, reader_license: str | None, extra: dict[str, str] | None,
                family: Family = FAMILIES["llama"]) -> str:
    undone = ["q/k rows un-permuted to HF rope layout"] if family.permute_qk else []
    undone += [f"norm weights stored as {family.norm_offset:g} + w by llama.cpp: offset removed"] \
        if family.norm_offset else []
    lines = {
        "source_file": gguf_path.name,
        "license": reader_license or "unknown",
        **(extra or {}),
        "gguf_sha256": sha256_file(gguf_path),
        "converted_by": "tdpipe.model.gguf.convert_gguf_to_hf_folder",
        "note": "; ".join(["weights dequantised from GGUF", *undone]),
    }
    return "".join(f"{k}: {v}\n" for k, v in lines.items())


def convert_gguf_to_hf_folder(
    gguf_path: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype | str = torch.bfloat16,
    provenance: dict[str, str] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a self-contained HF model folder converted from ``gguf_path``, its weights in ``dtype``
    (float32 keeps the dequantised values exactly, as transformers loads them from the file).

    Everything is written to a temporary sibling and moved into place with one
    ``os.replace``, so readers never see a half-written folder and a process that
    loses a conversion race just discards its copy. An existing folder is kept
    unless ``overwrite``.
    """
    gguf_path, out = Path(gguf_path), Path(out_dir)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if out.is_dir() and (out / "config.json").is_file() and not overwrite:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        reader = open_gguf(gguf_path)
        try:
            cfg, family = _config(reader)
            tensors = {name: w.to(dtype) for name, w in _progress(_tensors(reader, cfg, family),
                                                                   len(reader.tensors), gguf_path.name)}
        except ValueError as e:  # name the file: the conversion usually runs behind --model or the bundle
            from tdpipe.model.weights import ModelFileError

            raise ModelFileError(f"{gguf_path}: {e}") from None
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
        tok = _write_tokenizer(gguf_path, tmp, cfg, reader)
        gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": _stop_ids(reader, cfg, tok)}
        gen = {k: v for k, v in gen.items() if v not in (None, [])}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2), encoding="utf-8")
        license_ = _field(reader, "general.license")
        (tmp / "PROVENANCE.txt").write_text(_provenance(gguf_path, license_, provenance, family),
                                            encoding="utf-8")
        _move_into_place(tmp, out, overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op once moved
    return out


def _move_into_place(tmp: Path, out: Path, overwrite: bool) -> None:
    # mkdtemp and safetensors create owner-only modes; a shared cache should be readable.
    tmp.chmod(0o755)
    for f in tmp.iterdir():
        f.chmod(0o644)
    if overwrite and out.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, trash / out.name)
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.replace(tmp, out)  # atomic; succeeds onto a missing or empty directory
    except OSError:
        if not (out / "config.json").is_file():
            raise
        # another process finished first; its folder is equally good
