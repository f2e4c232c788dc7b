"""Unknown request fields: ignored (clients send newer OpenAI fields), named in the answer's header and logged,
but never as the client spelt them (a name with a newline would forge a log line or break the header) and
never remembered (a set of every name ever seen would grow without bound)."""
from __future__ import annotations

import logging
import time
from typing import Callable

from tdpipe.entrypoints.openai.protocol import _Request

__all__ = ["IGNORED_FIELDS_HEADER", "IgnoredFieldsLog", "ignored_fields_header", "ignored_names"]

log = logging.getLogger("tdpipe.serve")

IGNORED_FIELDS_HEADER = "x-tdpipe-ignored-fields"  # the unknown request fields this answer ignored


class IgnoredFieldsLog:
    """Logs the unknown fields requests carry, escaped (a name with a newline cannot forge a log line) and
    at most one line per `interval_s` (a client cannot flood the log); nothing is remembered per name."""

    def __init__(self, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.next_at = float("-inf")
        self.suppressed = 0

    def __call__(self, names: list[str]) -> None:
        if not names:
            return
        now = self.clock()
        if now < self.next_at:
            self.suppressed += 1
            return
        more = f" ({self.suppressed} more requests with unknown fields since the last line)" \
            if self.suppressed else ""
        log.warning("ignoring unknown request fields: %s%s", ", ".join(names), more)
        self.next_at, self.suppressed = now + self.interval_s, 0


MAX_IGNORED_NAMED = 16  # unknown fields named in an answer; beyond, a count
MAX_IGNORED_NAME_CHARS = 64


def ignored_names(req: _Request) -> list[str]:
    """The unknown fields of `req` that are safe to ignore (raises 400 for those that are not), each one
    escaped to printable ASCII and shortened, at most MAX_IGNORED_NAMED of them (then "+N more")."""
    names = req.unknown_fields()
    shown = [ascii(n[:MAX_IGNORED_NAME_CHARS]) for n in names[:MAX_IGNORED_NAMED]]
    if len(names) > MAX_IGNORED_NAMED:
        shown.append(f"+{len(names) - MAX_IGNORED_NAMED} more")
    return shown


def ignored_fields_header(names: list[str]) -> dict[str, str]:
    return {IGNORED_FIELDS_HEADER: ", ".join(names)} if names else {}
