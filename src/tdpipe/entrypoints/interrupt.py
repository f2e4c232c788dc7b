"""Ctrl-C at a step boundary: a KeyboardInterrupt that lands inside the scheduler or the page table would leave
them half-updated, so while a step runs the first SIGINT is only noted and raised as soon as the step is
done (a step is one micro-batch: well under a second in decode). A second SIGINT raises at once; the
engine then recovers by dropping everything in flight (LLMEngine.abort_all)."""
from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def deferred_sigint() -> Iterator[None]:
    """Run the body with SIGINT deferred to its end. A no-op off the main thread, or when someone else
    installed their own SIGINT handler (theirs keeps working unchanged)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
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
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if hits:
        raise KeyboardInterrupt


__all__ = ["deferred_sigint"]
