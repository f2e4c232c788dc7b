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
- a file written by `tdpipe predictor train` (model.py): the learned bucket classifier.
- `auto` (default): oracle for ignore_eos requests; for the others the learned predictor shipped for the
  serving model where there is one (tdpipe/predictor/data/), else the constant (recorded mean).
factory.py turns a spec ('oracle', 'constant:N', a file, ...) into one of them.
"""
from __future__ import annotations

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


__all__ = ["AutoPredictor", "ConstantPredictor", "OraclePredictor", "Predictor"]
