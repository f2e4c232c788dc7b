"""`tdpipe gpu-check calibrate FILE`: the simulator's row for the GPU a `tdpipe gpu-check run` ran on, from its
JSON (sim/gpu_calibrate.py), printed and optionally written for `tdpipe simulate --hardware ROW.json`."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tdpipe.bench.gpu_check import SCHEMA
from tdpipe.sim.hardware import TABLE, from_gpu_check


def add_parser(gpu_check: Any) -> argparse.ArgumentParser:
    c = gpu_check.add_parser("calibrate", help="the simulator's row for the GPU a check ran on, from its JSON")
    c.add_argument("file", help="a gpu-check JSON")
    c.add_argument("--base", default=None, choices=sorted(TABLE),
                   help="the datasheet row to start from (default: matched by the GPU's name)")
    c.add_argument("--json", default=None, metavar="FILE", help="write the row (then: simulate --hardware FILE)")
    c.set_defaults(fn=run)
    return c


def run(a: argparse.Namespace) -> int:
    try:
        doc = json.loads(Path(a.file).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"gpu-check JSON {a.file}: {e}") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ValueError(f"{a.file} is not a gpu-check JSON (no \"schema\": \"{SCHEMA}\")")
    text = json.dumps(from_gpu_check(doc, a.base).to_json(), indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text + "\n")
    return 0


__all__ = ["add_parser", "run"]
