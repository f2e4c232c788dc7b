"""Ctrl-C at a safe point. A KeyboardInterrupt that lands inside the scheduler or the page table would leave
them half-updated, and one inside a message exchange would leave the engine and its stages disagreeing.
So in such a section the first SIGINT is only noted, and handed to the handler that was there before (for
Python's default one: a KeyboardInterrupt) as soon as the section ends: for `LLM.generate`, when the
current step's micro-batch is back, well under a second in decode. A second SIGINT raises at once; the
engine then recovers by dropping everything in flight (LLMEngine.abort_all)."""
from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def deferred_sigint() -> Iterator[None]:
    """Run the body with SIGINT held until its end. A no-op off the main thread, or where SIGINT is not
    handled in Python (ignored, or a C handler)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.getsignal(signal.SIGINT)
    if not callable(old):
        yield
        return
    hits: list[int] = []

    def note(signum: int, frame: object) -> None:
        hits.append(signum)
        if len(hits) > 1:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, note)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
    if hits:
        old(signal.SIGINT, None)


__all__ = ["deferred_sigint"]
