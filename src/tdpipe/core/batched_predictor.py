"""Output-length prediction in batches, for the policies that ask for lengths (TD-Pipe §3.3).

A learned predictor encodes prompts in batches as they arrive; the scheduler still asks about one request
at a time. This wrapper is the predictor the scheduler sees: requests queue here as they are added, the
engine predicts a chunk while the stages compute, and a request the scheduler asks about before its chunk
was predicted leads the next chunk instead of being predicted alone.
"""
from __future__ import annotations

import time
from collections import deque

from tdpipe.core.engine_stats import EngineStats
from tdpipe.predictor.base import Predictor
from tdpipe.sequence import Sequence

PREDICT_CHUNK = 64  # prompts per predictor batch


class BatchedPredictor(Predictor):
    def __init__(self, inner: Predictor, stats: EngineStats) -> None:
        self.inner = inner
        self.name = inner.name
        self.stats = stats  # the engine's: counts what was predicted and the time it took
        self.pending: deque[Sequence] = deque()  # added, not predicted yet

    def add(self, seq: Sequence) -> None:
        self.pending.append(seq)

    def predict_pending(self, first: Sequence | None = None) -> None:
        """Predict up to PREDICT_CHUNK queued requests in one batch, `first` (asked about now) leading."""
        chunk = [first] if first is not None else []
        while self.pending and len(chunk) < PREDICT_CHUNK:
            s = self.pending.popleft()
            if s.predicted_output_len is None and not s.is_finished and s is not first:
                chunk.append(s)
        if chunk:
            t = time.perf_counter()
            self.stats.predicted += self.inner.predict_batch(chunk)
            self.stats.predict_seconds += time.perf_counter() - t

    def predict(self, seq: Sequence) -> int:
        if seq.predicted_output_len is None:
            self.predict_pending(first=seq)
        if seq.predicted_output_len is None:  # not the batched model's (e.g. an ignore_eos request: oracle)
            return self.inner.predict(seq)
        return seq.predicted_output_len

    def observe(self, seq: Sequence) -> None:
        self.inner.observe(seq)


__all__ = ["PREDICT_CHUNK", "BatchedPredictor"]
