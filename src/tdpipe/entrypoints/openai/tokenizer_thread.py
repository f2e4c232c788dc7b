"""Tokenising off the event loop: a request with megabytes of prompt must not freeze every other client."""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

__all__ = ["off_loop"]

T = TypeVar("T")

_tokenizer_pool: ThreadPoolExecutor | None = None


async def off_loop(fn: Callable[..., T], *args: Any, tokenizer: bool = True) -> T:
    """fn(*args) off the event loop. Work that uses the tokenizer (tokenising, chat templates, decoding)
    runs on the one tokenizer thread of the process: Hugging Face fast tokenizers are not safe to call from
    several threads at once, and one thread leaves the other cores to the engine. A huge prompt makes the
    other tokenising requests wait their turn, never the event loop (streams, /health, admission and
    token-id prompts, which go to asyncio's default threads, go on)."""
    global _tokenizer_pool
    loop = asyncio.get_running_loop()
    if not tokenizer:
        return await loop.run_in_executor(None, functools.partial(fn, *args))
    if _tokenizer_pool is None:
        _tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tdpipe-tokenizer")
    return await loop.run_in_executor(_tokenizer_pool, functools.partial(fn, *args))
