"""Reading Hugging Face checkpoint folders (config.json + safetensors).

Tensors are read one at a time so that a pipeline stage only ever
materialises the parameters it owns.

A damaged or incomplete folder is the commonest way a run fails before it starts (an interrupted
download or copy, a folder that only holds the tokenizer), so every problem found here is raised as a
ModelFileError: a ValueError the CLI prints as one line, naming the file and what is wrong with it.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# weights in formats tdpipe does not read: named in the error so the fix is obvious
_OTHER_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "tf_model.h5",
                  "flax_model.msgpack", "consolidated.00.pth")

NameFilter = Callable[[str], bool]
# a tensor-parallel rank's part of a tensor: (dim, start, end), or None for the whole tensor
Slicer = Callable[[str], "tuple[int, int, int] | None"]


class ModelFileError(ValueError):
    """A model folder or file that cannot be used (missing, truncated, corrupt). A ValueError so callers
    and the CLI treat it as bad input (one line, exit 2), not as a crash."""


class MissingModelFile(ModelFileError, FileNotFoundError):
    """A file the model needs is not there; also a FileNotFoundError for callers that catch that."""


def human_size(n: int) -> str:
    """Bytes as people compare them: '1.2 MB', '512 bytes'."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def load_hf_config(folder: str | Path) -> dict:
    """Read ``config.json``; fail with the path, since a bare KeyError or JSON traceback later is useless."""
    path = Path(folder) / "config.json"
    if not Path(folder).exists():
        raise MissingModelFile(f"model folder {folder} does not exist")
    if not path.is_file():
        raise MissingModelFile(f"model config not found: {path} (expected a Hugging Face model folder)")
    try:
        with path.open(encoding="utf-8") as f:
            cfg = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path} is not valid JSON (corrupt or truncated?): {e}") from None
    except OSError as e:
        raise ModelFileError(f"cannot read {path}: {e.strerror or e}") from None
    if not isinstance(cfg, dict):
        raise ModelFileError(f"{path} must hold a JSON object, got {type(cfg).__name__}")
    return cfg


def check_safetensors(path: str | Path) -> None:
    """Check one safetensors file against its own header without reading any tensor: the 8-byte header
    length, the JSON header, and that the file holds every byte the header's offsets point to. A
    truncated copy otherwise fails deep inside the loader with a message that names neither the file nor
    the cause."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelFileError(f"{path}: {human_size(size)}, too short to be a safetensors file "
                                     "(truncated or not safetensors)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ModelFileError(f"{path}: truncated or not safetensors: its header says {human_size(n)} of "
                                     f"metadata, the file has {human_size(size)} in all")
            raw = f.read(n)
    except FileNotFoundError:
        raise MissingModelFile(f"weights file not found: {path}") from None
    except OSError as e:
        raise ModelFileError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        header = json.loads(raw)
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        raise ModelFileError(f"{path}: corrupt safetensors header (not the JSON tensor table it must "
                             "start with)") from None
    need, have = max(ends, default=0), size - 8 - n
    if have < need:
        raise ModelFileError(f"{path}: truncated: header says {human_size(need)} of tensors, file has "
                             f"{human_size(have)}")


def _read_index(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not (isinstance(weight_map, dict) and all(isinstance(f, str) for f in weight_map.values())):
            raise TypeError
        return weight_map
    except (ValueError, KeyError, TypeError):
        raise ModelFileError(f"{index}: corrupt index (expected JSON with a 'weight_map' of tensor name -> "
                             "file)") from None


def _missing_weights(folder: Path) -> ModelFileError:
    other = [f for f in _OTHER_WEIGHTS if (folder / f).exists()]
    if other:
        return MissingModelFile(f"model folder {folder} has weights only as {other[0]}; tdpipe reads safetensors "
                                f"({SINGLE_FILE} or {INDEX_FILE} with its shards)")
    return MissingModelFile(f"model folder {folder} has no weights: no {SINGLE_FILE}, {INDEX_FILE} or "
                            "*.safetensors")


def _shard_plan(folder: Path, names: NameFilter | None) -> list[Path]:
    """Which safetensors files to open, skipping shards an index says hold nothing we want."""
    if not folder.is_dir():
        raise MissingModelFile(f"model folder {folder} does not exist (no safetensors to read)")
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = _read_index(index)
        wanted = [f for n, f in weight_map.items() if names is None or names(n)]
        shards = [folder / f for f in dict.fromkeys(wanted)]  # dedupe, keep order
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise MissingModelFile(f"{index} lists {len(missing)} shard(s) not in the folder: "
                                   f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
        return shards
    single = folder / SINGLE_FILE
    if single.is_file():
        return [single]
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise _missing_weights(folder)
    return shards


def check_weights(folder: str | Path, names: NameFilter | None = None) -> list[Path]:
    """Every shard the load will open, checked against its header (a few kB read per file), so a damaged
    last shard fails in a second instead of after the first shards were loaded. Returns the shards."""
    shards = _shard_plan(Path(folder), names)
    for shard in shards:
        check_safetensors(shard)
    return shards


def iter_safetensors(
    folder: str | Path, names: NameFilter | None = None, slicer: Slicer | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor in the checkpoint that ``names`` accepts.

    Unwanted tensors are never read from disk: safetensors maps the file and
    ``get_tensor`` only copies the one requested. Every shard is checked before the first is read.
    ``slicer``: a tensor-parallel rank reads only its rows or columns (``get_slice``), never the whole tensor.
    """
    for shard in check_weights(folder, names):
        try:
            with safe_open(str(shard), framework="pt") as f:
                for name in f.keys():
                    if names is None or names(name):
                        part = slicer(name) if slicer is not None else None
                        if part is None:
                            yield name, f.get_tensor(name)
                        else:
                            dim, a, b = part
                            sl = f.get_slice(name)
                            yield name, (sl[a:b] if dim == 0 else sl[:, a:b]).contiguous()
        except ModelFileError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors' own errors (SafetensorError) name no file
            raise ModelFileError(f"{shard}: cannot read safetensors (corrupt?): {_one_line(e)}") from None


# Checkpoint names -> the decoder's (Llama's) names, one table for every family: (prefix, replacement or None
# for tensors no decoder reads). Families whose names are Llama's (Mistral, Qwen2/3, Gemma3ForCausalLM, Phi-3:
# its qkv_proj / gate_up_proj are simply stored fused) need no row. Gemma3ForConditionalGeneration keeps the
# text decoder under language_model (transformers 4: language_model.model.*, 5: model.language_model.*).
NAME_MAP: tuple[tuple[str, str | None], ...] = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("vision_tower.", None), ("model.vision_tower.", None),
    ("multi_modal_projector.", None), ("model.multi_modal_projector.", None),
)


def canonical_name(name: str) -> str | None:
    """The decoder's name for checkpoint tensor `name` (NAME_MAP); None: a tensor no decoder reads."""
    for prefix, repl in NAME_MAP:
        if name.startswith(prefix):
            return None if repl is None else repl + name[len(prefix):]
    return name


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# Any one of these holds a vocabulary transformers can build a tokenizer from (vocab.json also needs
# merges.txt). tokenizer_config.json alone does not: transformers then falls back to a slow class and
# reports a missing optional package ("install sentencepiece"), which sends the user the wrong way.
_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json",
                "vocab.txt")


def check_tokenizer_files(path: str) -> None:
    """Fail with the folder and the missing file names when a model folder has no tokenizer."""
    if not os.path.isdir(path):
        raise MissingModelFile(f"model folder {path} does not exist (no tokenizer to load)")
    present = set(os.listdir(path))
    if not present & set(_VOCAB_FILES):
        raise MissingModelFile(f"model folder {path} has no tokenizer files: none of tokenizer.json, "
                               "tokenizer.model or vocab.json + merges.txt (copy them from the model's "
                               "original folder)")
    if present & set(_VOCAB_FILES) == {"vocab.json"} and "merges.txt" not in present:
        raise MissingModelFile(f"model folder {path} has vocab.json but no merges.txt: the tokenizer needs both")


def check_model_folder(folder: str | Path, tokenizer: bool = True) -> dict[str, Any]:
    """All of a model folder's parts, checked before anything heavy starts: config.json, the weights
    (headers against file sizes) and, when wanted, the tokenizer files. Returns the config. Meant for
    callers that load a model (the engine); the simulator reads configs alone and calls load_hf_config."""
    cfg = load_hf_config(folder)
    check_weights(folder)
    if tokenizer:
        check_tokenizer_files(os.fspath(folder))
    return cfg


__all__ = ["INDEX_FILE", "NAME_MAP", "canonical_name", "SINGLE_FILE", "MissingModelFile", "ModelFileError", "check_model_folder",
           "check_safetensors", "check_tokenizer_files", "check_weights", "human_size", "iter_safetensors", "load_hf_config"]
