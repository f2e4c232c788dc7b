"""What one engine step says about one request: token ids only, no text (vLLM v1's EngineCoreOutput).

The engine core emits these; the frontend's OutputProcessor turns them into text and RequestOutputs. They
cross the process boundary when serving (core/async_llm.py), so they hold plain values only.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestDelta:
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" once finished (the core never sees stop strings)
    stop_reason: int | None = None  # the stop token id that ended it, if one did
    num_preemptions: int = 0
