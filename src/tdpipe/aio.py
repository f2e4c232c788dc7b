"""The event loop every tdpipe asyncio entry point runs on: uvloop where installed (as vLLM serves), else
asyncio's own. The serving frontend, run-batch and bench serve share the machine's cores with the engine, so
the cheaper loop leaves more of them to the model."""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:  # an optional speed-up: the asyncio loop does the same work
        return asyncio.run(coro)
    return uvloop.run(coro)
