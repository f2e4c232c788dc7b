"""Ctrl-C at a safe point. A KeyboardInterrupt that lands inside the scheduler or the page table would leave
them half-updated, and one inside a message exchange would leave the engine and its stages disagreeing.
So in such a section the first SIGINT is only noted, and handed to the handler that was there before (for
Python's default one: a KeyboardInterrupt) as soon as the section ends: for `LLM.generate`, when the
current step's micro-batch is back, well under a second in decode. A second SIGINT raises at once; the
engine then recovers by dropping everything in flight (LLMEngine.abort_all)."""
from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")
DROPPED_POLL_S = 0.1  # how often a wait on another thread looks for a dropped Ctrl-C


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


_dropped = False  # a SIGINT was turned into a KeyboardInterrupt that may never have reached the caller


def sticky_sigint(signum: int, frame: object) -> None:
    """Python's own Ctrl-C (a KeyboardInterrupt), remembered. The interpreter prints and drops an exception
    raised inside a `__del__` or a weakref callback (a garbage collection during an import is enough), and
    the run then went on as if Ctrl-C had never been pressed; `raise_if_dropped` raises it again at the next
    safe point. The `tdpipe` command installs this once its arguments are parsed."""
    global _dropped
    _dropped = True
    raise KeyboardInterrupt


def _quiet_when_dropped(unraisable: "sys.UnraisableHookArgs") -> None:
    """sys.unraisablehook: a KeyboardInterrupt from `sticky_sigint` that the interpreter drops (in a
    `__del__`, a weakref or gc callback) is not printed as "Exception ignored ... Traceback": it is not
    lost, `raise_if_dropped` raises it again. Anything else goes to the hook that was there before."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt) and _dropped:
        return
    _previous_hook(unraisable)


_previous_hook = sys.unraisablehook


def install_sticky_sigint() -> None:
    """Ctrl-C as a KeyboardInterrupt that is never lost nor printed as a traceback where it was dropped
    (the `tdpipe` command, once its arguments are parsed). Main thread only, like any signal handler."""
    global _previous_hook
    signal.signal(signal.SIGINT, sticky_sigint)
    if sys.unraisablehook is not _quiet_when_dropped:
        _previous_hook = sys.unraisablehook
        sys.unraisablehook = _quiet_when_dropped


def raise_if_dropped() -> None:
    """Raise the KeyboardInterrupt of a Ctrl-C that `sticky_sigint` saw and nothing handled (a caller that
    catches KeyboardInterrupt and carries on clears it with `clear_dropped`)."""
    global _dropped
    if _dropped:
        _dropped = False
        raise KeyboardInterrupt


def result_or_interrupt(fut: "Future[T]") -> T:
    """fut.result(), raising meanwhile the Ctrl-C the interpreter dropped. A KeyboardInterrupt dropped in
    importlib's own weakref callback (a module lock's `cb`, between taking the global import lock and its
    `try`) leaves that lock held by this thread: a thread that imports (the tokenizer's, importing
    transformers) then never finishes, and a plain result() waited for it forever (a fault test's Ctrl-C at
    start-up)."""
    while True:
        raise_if_dropped()
        try:
            return fut.result(timeout=DROPPED_POLL_S)
        except FutureTimeout:
            continue


def clear_dropped() -> None:
    global _dropped
    _dropped = False


__all__ = ["clear_dropped", "deferred_sigint", "install_sticky_sigint", "raise_if_dropped",
           "result_or_interrupt", "sticky_sigint"]
