"""Output-length predictors for TD-Pipe's AI-based greedy prefill (§3.3). Pure Python.

Algorithm 1 needs each request's output length ahead of time to simulate the KV usage at future decode
steps. A predictor answers `predict(seq)` (tokens to generate, counted from the start of the output) and
learns from `observe(seq)` when a request finishes. The learned (BERT) predictor is issue 5's; here:

- `oracle`: the request's true length where ignore_eos forces it (max_tokens); without ignore_eos, max_tokens
  is only an upper bound, so the prediction is conservative.
- `constant[:N]`: one length for every request, N or else the mean of the outputs recorded so far (this
  engine's finished requests); max_tokens until the first one finishes. Never more than max_tokens.
- `auto` (default): oracle for ignore_eos requests, constant (recorded mean) for the others.
"""
from __future__ import annotations

from tdpipe.sequence import Sequence


class Predictor:
    name = "base"

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
    name = "auto"

    def predict(self, seq: Sequence) -> int:
        if getattr(seq.sampling_params, "ignore_eos", False):
            return seq.max_tokens
        return super().predict(seq)


def make_predictor(spec: str) -> Predictor:
    """'oracle' | 'constant' | 'constant:N' | 'auto'. ValueError names the field."""
    kind, _, arg = spec.partition(":")
    if kind == "oracle" and not arg:
        return OraclePredictor()
    if kind == "auto" and not arg:
        return AutoPredictor()
    if kind == "constant":
        if not arg:
            return ConstantPredictor()
        if arg.isdigit() and int(arg) >= 1:
            return ConstantPredictor(int(arg))
    raise ValueError(f"predictor must be 'auto', 'oracle', 'constant' or 'constant:N' with N >= 1, got {spec!r}")


__all__ = ["AutoPredictor", "ConstantPredictor", "OraclePredictor", "Predictor", "make_predictor"]
