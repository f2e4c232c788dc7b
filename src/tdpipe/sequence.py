"""Request state as the scheduler and engine see it; no torch here."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not yet prefilled, or preempted (recompute) and waiting again
    RUNNING = "running"  # KV in the cache, decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request. Its KV lives in the blocks of `block_table`; `num_computed_tokens` of its tokens have KV."""

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any  # tdpipe.sampling.SamplingParams (kept untyped: no import cycle, no torch)
    prompt: str | None = None
    max_tokens: int = 16  # resolved limit: sampling_params.max_tokens or what max_model_len leaves
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "error"
    stop_reason: int | str | None = None
    output_text: str = ""
    predicted_output_len: int | None = None  # TD-Pipe §3.3 (filled by a predictor)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    in_flight: bool = False  # part of a micro-batch that has not returned yet

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def reset_for_recompute(self) -> None:
        """Recompute preemption: drop the KV; the prompt and the outputs so far are prefilled again later."""
        self.block_table = []
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1  # also the KV epoch: stages drop their copy of the old block table
