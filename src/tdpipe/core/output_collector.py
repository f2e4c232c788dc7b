"""One pending output per request, whatever its reader does (vLLM v1's RequestOutputCollector idea).

The loop that reads the core's outputs must never wait for a client, and a client that stops reading must
not make memory grow. So each request has one slot, not a queue: a step that advances the request only
marks the slot, and the reader renders the request's cumulative output from its live state when it reads
(every step's news merges into that one output). A reader that never reads costs the request's own state,
nothing per step. An error (the core died, the request was refused) replaces whatever is pending: it ends
the request.
"""
from __future__ import annotations

import asyncio
from typing import Callable

from tdpipe.outputs import RequestOutput

__all__ = ["RequestOutputCollector"]


class RequestOutputCollector:
    """`render()` builds the request's output from its current state; `notify()` says it advanced;
    `fail(e)` ends it with an error; `get()` waits for news and returns the newest output."""

    __slots__ = ("_render", "_error", "_ready")

    def __init__(self, render: Callable[[], RequestOutput]) -> None:
        self._render = render
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def notify(self) -> None:
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._ready.set()

    @property
    def pending(self) -> bool:
        return self._ready.is_set()

    async def get(self) -> RequestOutput:
        """The newest output (every advance since the last get merged in it); raises the error if it failed."""
        await self._ready.wait()
        self._ready.clear()
        if self._error is not None:
            raise self._error
        return self._render()
