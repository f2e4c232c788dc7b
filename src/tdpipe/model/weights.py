"""Reading Hugging Face checkpoint folders (config.json + safetensors).

Tensors are read one at a time so that a pipeline stage only ever
materialises the parameters it owns.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

NameFilter = Callable[[str], bool]


def load_hf_config(folder: str | Path) -> dict:
    """Read ``config.json``; fail with the path, since a bare KeyError later is useless."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model config not found: {path} (expected a Hugging Face model folder)")
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def _shard_plan(folder: Path, names: NameFilter | None) -> list[Path]:
    """Which safetensors files to open, skipping shards an index says hold nothing we want."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        wanted = [f for n, f in weight_map.items() if names is None or names(n)]
        return [folder / f for f in dict.fromkeys(wanted)]  # dedupe, keep order
    single = folder / SINGLE_FILE
    if single.is_file():
        return [single]
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors in {folder}")
    return shards


def iter_safetensors(
    folder: str | Path, names: NameFilter | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor in the checkpoint that ``names`` accepts.

    Unwanted tensors are never read from disk: safetensors maps the file and
    ``get_tensor`` only copies the one requested.
    """
    for shard in _shard_plan(Path(folder), names):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                if names is None or names(name):
                    yield name, f.get_tensor(name)
