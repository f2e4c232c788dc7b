"""What generate() returns; the names follow vLLM's RequestOutput so user code ports unchanged."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "error"
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    error: str | None = None  # set when the request was rejected; the other requests still complete
    metrics: RequestMetrics | None = field(default=None, repr=False)
