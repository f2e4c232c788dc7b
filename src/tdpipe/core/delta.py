"""What one engine step says about one request: token ids only, no text (vLLM v1's EngineCoreOutput).

The engine core emits these; the frontend's OutputProcessor turns them into text and RequestOutputs. They
cross the process boundary when serving (core/async_llm.py), so they hold plain values only.
"""
from __future__ import annotations

from dataclasses import dataclass

# One position's log-probabilities: (token id, logprob, rank) triples, the sampled (or prompt) token first,
# then the top-k in rank order (the sampled token may appear twice, as in vLLM's dict it appears once).
TokenLogprobs = list[tuple[int, float, int]]


@dataclass(slots=True)  # one per sequence per step: built, pickled to the frontend and read on the hot path
class RequestDelta:
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" once finished (the core never sees stop strings)
    stop_reason: int | None = None  # the stop token id that ended it, if one did
    num_preemptions: int = 0
    index: int = 0  # which of the request's samples (n > 1 or best_of): CompletionOutput.index
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked for logprobs
    cumulative_logprob: float | None = None  # after the new tokens (logprobs or best_of requests)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # whole, with the request's first token
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache held, with the request's first token
