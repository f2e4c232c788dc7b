"""What generate() returns; the names follow vLLM's RequestOutput so user code ports unchanged."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability at one position, as vLLM reports it. `rank`: 1 = the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob, holding the top-k tokens and the sampled (or prompt) token.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]  # entry 0 is None: the first prompt token has no context


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "error" | "abort"
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs (with logprobs or best_of)
    logprobs: SampleLogprobs | None = None  # with SamplingParams(logprobs=k): one entry per token

    def finished(self) -> bool:
        """vLLM's: whether this sample has ended."""
        return self.finish_reason is not None


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
    prompt_logprobs: PromptLogprobs | None = None  # with SamplingParams(prompt_logprobs=k)
    weight_version: int = 0  # the engine's weights that produced it: 0 as loaded, +1 per update_weights
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache, not computed again (vLLM's)
