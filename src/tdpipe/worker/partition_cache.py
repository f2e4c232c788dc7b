"""The partition's measured stage costs (StageCosts.measure), kept in $TDPIPE_CACHE/profiles.

Balancing the stages of a pp > 1 engine times one decoder layer, the embedding and the head on random
weights at start-up (0.8 s of each start here). What it measures depends only on the model's shapes, the
dtype, the threads, the batch, the device and the software that runs it, all in the key, so the first
start on a machine measures and later ones read the result: they start sooner and, since timing noise no
longer moves the chosen layers, every start of the same engine gets the same partition (which the step
profile's key includes, so that cache hits too). A damaged or foreign file is measured again and
overwritten; `use_cache=False` (`--no-profile-cache`) always measures.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Any

from tdpipe.config import ModelConfig
from tdpipe.platforms.interface import Platform
from tdpipe.worker.partition import PhaseCosts, StageCosts

COSTS_VERSION = 1  # bump when StageCosts.measure times something else
_FIELDS = ("embed", "layer", "head")


def measured_costs(cfg: ModelConfig, dtype: Any, threads: int, batch: int, platform: Platform,
                   use_cache: bool = True) -> PhaseCosts:
    """StageCosts.measure(cfg, dtype, threads, batch=batch, platform=platform), read from the cache when a
    measurement with the same key is there."""
    if not use_cache:
        return StageCosts.measure(cfg, dtype, threads, batch=batch, platform=platform)
    key = costs_key(cfg, dtype, threads, batch, platform)
    path = _path(key)
    try:
        return parse_costs(json.loads(path.read_text()), key)
    except (OSError, ValueError):  # missing, unreadable, damaged or another key: measure
        pass
    costs = StageCosts.measure(cfg, dtype, threads, batch=batch, platform=platform)
    _save(path, costs, key)
    return costs


def costs_key(cfg: ModelConfig, dtype: Any, threads: int, batch: int, platform: Platform) -> dict:
    """Everything the timed layer depends on: one layer's config, dtype, threads, batch and what runs it."""
    from tdpipe.model.cache import runtime_key
    from tdpipe.version import __version__

    one = dataclasses.replace(cfg, num_layers=1, layer_windows=cfg.layer_windows[:1], gguf_file="")
    key = {"version": COSTS_VERSION, "model": dataclasses.asdict(one), "dtype": str(dtype), "threads": threads,
           "batch": batch, "device": platform.name, "tdpipe": __version__, **runtime_key()}
    return json.loads(json.dumps(key, default=str))  # as JSON gives it back: tuples are lists


def parse_costs(data: Any, key: dict) -> PhaseCosts:
    """A cached measurement back as PhaseCosts; ValueError saying what is wrong with it."""
    if not isinstance(data, dict) or data.get("key") != key:
        raise ValueError("not a measurement for this key")
    phases = {}
    for phase in ("decode", "prefill"):
        v = data.get(phase)
        if not isinstance(v, dict):
            raise ValueError(f"{phase} is missing")
        for f in _FIELDS:
            x = v.get(f)
            if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x) or x <= 0:
                raise ValueError(f"{phase}.{f} is {x!r}, not a finite number > 0")
        phases[phase] = StageCosts(float(v["embed"]), float(v["layer"]), float(v["head"]))
    return PhaseCosts(decode=phases["decode"], prefill=phases["prefill"])


def _path(key: dict) -> Path:
    from tdpipe.model.cache import profiles_dir

    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return profiles_dir() / f"partition-{digest}.json"


def _save(path: Path, costs: PhaseCosts, key: dict) -> None:
    """A cache that cannot be written costs the next start a measurement, nothing more."""
    from tdpipe.model.cache import write_json

    data = {p: {f: getattr(getattr(costs, p), f) for f in _FIELDS} for p in ("decode", "prefill")}
    try:
        write_json(path, data | {"key": key})
    except OSError:
        pass


__all__ = ["COSTS_VERSION", "costs_key", "measured_costs", "parse_costs"]
