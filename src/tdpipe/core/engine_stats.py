"""The engine's running counters (the bench, the simulator and the server's /metrics read them)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    output_tokens: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    mixed_steps: int = 0  # hybrid: decodes and prefill chunks in one micro-batch
    predict_seconds: float = 0.0  # time spent predicting output lengths (batched, as requests arrive)
    predicted: int = 0
    started: float = field(default_factory=time.time)

    def count_step(self, num_decode: int, num_seqs: int, num_tokens: int, num_sampled: int) -> None:
        """A micro-batch returned: `num_decode` of its `num_seqs` rows were decodes (one new token over a
        cached prefix; the rest prefilled prompt), and `num_sampled` tokens were sampled from it."""
        if num_decode == num_seqs:
            self.decode_steps += 1
        elif num_decode:
            self.mixed_steps += 1
        else:
            self.prefill_steps += 1
        self.prompt_tokens += num_tokens - num_decode
        self.output_tokens += num_sampled


__all__ = ["EngineStats"]
