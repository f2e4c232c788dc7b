"""tdpipe's cache folder ($TDPIPE_CACHE, or ~/.cache/tdpipe) and the model folders kept in it.

Everything derived from a model once and reused is kept here: GGUF conversions and random-weight models
(model/bundled.py, model/random_model.py), compiled kernels (model/jit.py), step profiles, the partition's
stage costs (worker/partition_cache.py) and calibrations,
keyed by model_identity. A model entry is built in a temporary folder beside it and renamed into place
with a manifest (file names and sizes, written last), so a kill mid-build never leaves a folder that looks
complete; check_entry reads the manifest (a few stats) on every load and says what is wrong with a damaged
entry, which its builder then makes again.
"""
from __future__ import annotations

import json
import os
import struct
import sys
import threading
from pathlib import Path
from typing import Any

MANIFEST = "tdpipe-manifest.json"
CONVERTER_VERSION = 1  # bump when model/gguf.py writes different folders: old entries are converted again
_REQUIRED = ("config.json", "tokenizer.json", "tokenizer_config.json")
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


class CacheDirError(ValueError):
    """TDPIPE_CACHE (or the default ~/.cache/tdpipe) cannot hold the cache: one line for the user."""


def notice(msg: str) -> None:
    """One line on stderr: what a cache is doing (conversions, rebuilds) even where logging is off."""
    print(f"tdpipe: {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """``$TDPIPE_CACHE`` or ``~/.cache/tdpipe``, created if missing; read on every call so tests can redirect
    it. Raises CacheDirError when it is not a writable directory (a file, a read-only or impossible path)."""
    env = os.environ.get("TDPIPE_CACHE")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "tdpipe"
    what = f"TDPIPE_CACHE={env}" if env else f"the default cache {root} (set TDPIPE_CACHE to use another)"
    hint = "point TDPIPE_CACHE at a writable directory"
    try:  # no look before the leap: another process may create it between a look and mkdir (a first run
        root.mkdir(parents=True, exist_ok=True)  # of two at once: a stage and the kernel-build thread)
    except FileExistsError:  # there, but not a directory
        kind = "a dangling link" if root.is_symlink() and not root.exists() else "not a directory"
        raise CacheDirError(f"{what}: {root} is {kind}; {hint}") from None
    except OSError as e:
        raise CacheDirError(f"{what}: cannot create {root} ({e.strerror or e}); {hint}") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise CacheDirError(f"{what}: {root} is not writable; {hint}")
    return root


# -- model entries ------------------------------------------------------------------------------------
def profiles_dir() -> Path:
    """$TDPIPE_CACHE/profiles: start-up measurements (step profiles, the partition's stage costs)."""
    return cache_dir() / "profiles"


def write_json(path: Path, data: Any, indent: int | None = 1) -> None:
    """`data` as JSON at `path` (its folder created), written to a private temporary file and renamed into
    place, so a reader never sees half a file (the temporary name is the thread's own, so two writers of one
    path race only to the rename). OSError propagates: the caller says what was not cached."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data, indent=indent))
    tmp.replace(path)


def _safetensors_ok(path: Path) -> str | None:
    """Truncation check from the header alone: the data must end exactly at the file's end."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path.name} is truncated ({size} bytes)"
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                return f"{path.name} is truncated (header of {n} bytes, file of {size})"
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        return f"{path.name} is unreadable ({type(e).__name__})"
    if 8 + n + end != size:
        return f"{path.name} has {size} bytes, its header says {8 + n + end}"
    return None


def _structure(folder: Path) -> str | None:
    """What is missing or broken in an entry without a manifest (None: complete). Reads the weights'
    headers, not the weights."""
    for name in _REQUIRED:
        f = folder / name
        if not f.is_file() or f.stat().st_size == 0:
            return f"{name} is missing" if not f.is_file() else f"{name} is empty"
    try:
        json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "config.json is unreadable"
    if (folder / _WEIGHTS[0]).is_file():
        return _safetensors_ok(folder / _WEIGHTS[0])
    if (folder / _WEIGHTS[1]).is_file():
        try:
            index = json.loads((folder / _WEIGHTS[1]).read_text(encoding="utf-8"))
            shards = set(index["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError):
            return f"{_WEIGHTS[1]} is unreadable"
        for s in sorted(shards):
            why = _safetensors_ok(folder / s) if (folder / s).is_file() else f"{s} is missing"
            if why:
                return why
        return None
    return "the weights (model.safetensors) are missing"


def write_manifest(folder: Path, source: dict[str, Any]) -> None:
    """Record every file's size and the source; written last (atomically), so its presence means done."""
    files = {f.name: f.stat().st_size for f in sorted(folder.iterdir()) if f.is_file() and f.name != MANIFEST}
    data = {"version": CONVERTER_VERSION, "source": source, "files": files}
    tmp = folder / f".{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
    tmp.chmod(0o644)
    os.replace(tmp, folder / MANIFEST)


def check_entry(folder: Path, source: dict[str, Any] | None) -> str | None:
    """Why the cache entry is not usable, or None. Cheap enough for every load: the manifest and one stat
    per file. A complete entry from before manifests (it passes `_structure`) gets one now. `source`
    None: any source will do (the GGUF it came from is not installed)."""
    if not folder.is_dir():
        return "missing" if not folder.exists() else "not a folder"
    try:
        data = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        why = _structure(folder)
        if why is None and source is not None:
            try:
                write_manifest(folder, source)
            except OSError:
                pass  # still usable; checked again next time
        return why
    except (OSError, ValueError) as e:
        return f"its manifest is unreadable ({type(e).__name__})"
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        return "its manifest is malformed"
    if data.get("version") != CONVERTER_VERSION:
        return f"it was written by converter version {data.get('version')}, this is {CONVERTER_VERSION}"
    if source is not None and data.get("source") != source:
        return f"it was converted from {data.get('source')}, not {source}"
    files = data["files"]
    for name in _REQUIRED:
        if name not in files:
            return f"{name} is missing"
    if not any(w in files for w in _WEIGHTS):
        return "the weights (model.safetensors) are missing"
    for name, size in files.items():
        try:
            actual = (folder / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual} bytes, expected {size}" + (" (truncated)" if actual < size else "")
    return None


def runtime_key() -> dict[str, Any]:
    """What a timing measured here depends on besides the model and the run's settings: whether the C++
    kernels run, the CPU and its cores, torch, and which dtypes' linears run packed. Part of the key of every
    cache of measured timings (step profiles, partition costs, calibrations)."""
    import torch

    from tdpipe.config import cpu_name
    from tdpipe.model.packed_linear import packed_dtypes

    return {"kernels": os.environ.get("TDPIPE_NO_KERNEL") != "1", "cpu": cpu_name(), "cores": os.cpu_count(),
            "torch": torch.__version__, "packed_linear": packed_dtypes()}


def model_identity(path: str | os.PathLike[str]) -> list[list[Any]]:
    """Name, size and mtime of the files that define a model folder (or file): for the keys of caches
    derived from a model (step profiles, calibrations), so a rebuilt or edited model gets new entries."""
    p = Path(path)
    out = []
    for f in sorted(p.iterdir()) if p.is_dir() else [p]:
        if f.suffix in (".json", ".safetensors", ".gguf") and f.name != MANIFEST and f.is_file():
            st = f.stat()
            out.append([f.name, st.st_size, st.st_mtime_ns])
    return out


__all__ = ["MANIFEST", "CacheDirError", "cache_dir", "check_entry", "model_identity", "notice", "write_manifest"]
