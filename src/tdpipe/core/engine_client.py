"""What the OpenAI server needs from an engine: the typed contract (vLLM's EngineClient idea).

`AsyncLLM` (core/async_llm.py) satisfies it over an engine core in another process; tests satisfy it with a
fake (tests/fake_engine_client.py). The server holds an `EngineClient | None` (None while it starts) and
reads nothing else, so a new engine front (another transport, a remote core) is one class that matches this.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, runtime_checkable

from tdpipe.core.validation import EngineRequest
from tdpipe.outputs import RequestOutput
from tdpipe.sampling.params import SamplingParams

__all__ = ["EngineClient", "EngineDeadError", "as_engine_request"]


class EngineDeadError(RuntimeError):
    """The engine core is gone. The message is safe to show a client: it never holds the core's exception
    text (that goes to the server's log only)."""


def as_engine_request(prompt: EngineRequest | str | list[int], params: SamplingParams | None,
                      request_id: str | None,
                      validate: Callable[[str | list[int], SamplingParams, str], EngineRequest]) -> EngineRequest:
    """generate()'s two forms: an EngineRequest (validated by the caller) as it is, or a raw prompt with its
    params and request id, validated by `validate` (a client's request()); TypeError for a mix of the two."""
    if isinstance(prompt, EngineRequest):
        if params is not None or request_id is not None:
            raise TypeError("generate(EngineRequest) takes no params or request_id: the request has them")
        return prompt
    if params is None or request_id is None:
        raise TypeError("generate(prompt, params, request_id): params and request_id are required")
    return validate(prompt, params, request_id)


@runtime_checkable
class EngineClient(Protocol):
    """An engine the server can drive. `max_model_len`, `max_num_seqs` and `vocab_size` are the limits
    requests are validated against (core/validation.py: RequestLimits.of)."""

    tokenizer: Any
    model_name: str
    max_model_len: int
    max_num_seqs: int
    vocab_size: int
    ready: bool  # False while starting and after the core died or was shut down
    default_sampling: dict[str, Any]  # the model's defaults for omitted sampling fields (sampling/defaults.py)
    eos_token_ids: frozenset[int]  # the ids that end an answer (the model's EOS and generation_config's)
    dead_reason: str | None  # why the core is gone (client-safe text); None while it runs

    def generate(self, prompt: EngineRequest | str | list[int], params: SamplingParams | None = None,
                 request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """The request's cumulative outputs as it advances; the last has finished=True. A validated
        EngineRequest runs as it is; a raw prompt is tokenised and validated first (ValueError if refused).
        Leaving the iterator early aborts the request in the core."""
        ...

    async def abort(self, request_id: str) -> None:
        """Finish the request with finish_reason "abort"."""
        ...

    def stats(self) -> dict[str, Any]:
        """The latest engine snapshot (num_running, num_waiting, kv_usage, ...), without a round trip;
        num_unfinished, if present, counts the requests not finished in the engine, without delay."""
        ...

    def check_health(self) -> None:
        """Raise EngineDeadError unless the engine answers requests."""
        ...

    async def shutdown(self, grace_s: float = 10.0) -> None:
        """Let open requests finish for up to grace_s seconds, abort the rest, stop the core."""
        ...
