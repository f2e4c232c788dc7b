"""Where `tdpipe generate` puts its answers: one JSON line per request, written and flushed as it finishes, so
Ctrl-C, a killed stage or a full disk never costs a finished answer; and `--resume`, which reads back what an
earlier run of the same input left and answers only the rest."""
from __future__ import annotations

import json
import os
import sys
from typing import Any

from tdpipe.entrypoints.preflight import PreflightError


def jsonl_bytes(rec: Any) -> bytes:
    """One JSONL line as UTF-8. Text stays readable (ensure_ascii=False), except an unpaired surrogate, which
    UTF-8 cannot hold (a refused prompt is echoed as given): it is written as its JSON escape, `\\ud800`,
    which reads back as the same string."""
    return (json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8", "backslashreplace")


class ResultSink:
    """Writes records keyed by their input position ('index'). `ordered`: input order, holding back only the
    records that finish before an earlier one. `resume`: keep the records already in `path` (`done`)."""

    def __init__(self, path: str | None, ordered: bool = False, resume: bool = False) -> None:
        self.path = path
        self.ordered = ordered
        self.resume = resume
        self.fd: int | None = None
        self.done: set[int] = set()  # input positions answered in the file before this run
        self.prev_prompts: dict[int, Any] = {}
        self.prev_failed = 0
        self.written = 0  # records written by this run
        self.failed = 0
        self.write_failed = False
        self._pending: dict[int, dict] = {}
        self._next = 0  # ordered: the next input position to write
        if resume and path and os.path.exists(path):
            self._read_existing(path)

    # -- resume -------------------------------------------------------------------------------------------
    def _read_existing(self, path: str) -> None:
        with open(path, "rb") as f:
            data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):  # a line cut by a kill or a full disk: it is answered again
            print(f"tdpipe: --resume: dropping the unfinished last line of {path}", file=sys.stderr)
            with open(path, "r+b") as f:
                f.truncate(end)
        for n, line in enumerate(data[:end].splitlines(), 1):
            try:
                rec = json.loads(line)
                i = rec["index"]
            except (ValueError, KeyError, TypeError):
                raise PreflightError(f"--resume: line {n} of {path} is not a tdpipe generate record "
                                     "(JSON with an 'index'); was it written by an older tdpipe?") from None
            self.done.add(i)
            self.prev_prompts[i] = rec.get("prompt")
            self.prev_failed += "error" in rec

    def check_resumed(self, recs: list[dict]) -> None:
        """The file must come from the same input: every index in range, every prompt text the same."""
        for i, prompt in self.prev_prompts.items():
            if not isinstance(i, int) or not 0 <= i < len(recs):
                raise PreflightError(f"--resume: {self.path} answers prompt index {i}, but the input has "
                                     f"{len(recs)} prompts; it was written for a different input")
            now = recs[i].get("prompt")
            if isinstance(prompt, str) and isinstance(now, str) and prompt != now and "messages" not in recs[i]:
                raise PreflightError(f"--resume: prompt {i} in {self.path} differs from the input's; it was "
                                     "written for a different input")
        if self.done:
            print(f"tdpipe: --resume: {len(self.done)} of {len(recs)} prompts already answered in {self.path}",
                  file=sys.stderr)

    # -- writing ------------------------------------------------------------------------------------------
    def __enter__(self) -> "ResultSink":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None and self.path:
            os.close(self.fd)
            self.fd = None

    def write(self, index: int, rec: dict) -> None:
        if not self.ordered:
            self._write_line(rec)
            return
        self._pending[index] = rec
        self._flush_ordered()

    def _flush_ordered(self) -> None:
        while True:
            while self._next in self.done:
                self._next += 1
            rec = self._pending.pop(self._next, None)
            if rec is None:
                return
            self._write_line(rec)
            self._next += 1

    def _open(self) -> int:
        if self.fd is None:
            if self.path:
                flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if self.resume else os.O_TRUNC)
                self.fd = os.open(self.path, flags, 0o644)
            else:
                sys.stdout.flush()
                self.fd = sys.stdout.fileno()
        return self.fd

    def _write_line(self, rec: dict) -> None:
        """One whole line or nothing: a failed write (disk full) is cut back to the previous line."""
        data = jsonl_bytes(rec)
        fd = self._open()
        pos = os.lseek(fd, 0, os.SEEK_END) if self.path else None
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError:
            self.write_failed = True
            if pos is not None:
                try:
                    os.ftruncate(fd, pos)
                except OSError:
                    pass
            raise
        self.written += 1
        self.failed += "error" in rec

    # -- the end ------------------------------------------------------------------------------------------
    def _where(self) -> str:
        return self.path or "stdout"

    def finish(self, total: int) -> int:
        """All answered: a summary on stderr; exit code 1 when any request failed."""
        failed = self.failed + self.prev_failed
        if self.path:
            print(f"tdpipe: {len(self.done) + self.written} of {total} prompts answered in {self.path}"
                  + (f"; {failed} failed (see their 'error')" if failed else ""), file=sys.stderr)
        elif failed:
            print(f"tdpipe: {failed} of {total} requests failed (see their 'error')", file=sys.stderr)
        return 1 if failed else 0

    def stopped(self, total: int, why: str, code: int) -> int:
        """The run ended early: save what finished (held back for order or not), say where, how to go on."""
        held = [self._pending[i] for i in sorted(self._pending)]
        self._pending.clear()
        try:
            for rec in held:  # out of order now, but finished work is never dropped
                self._write_line(rec)
        except OSError:
            pass
        n = len(self.done) + self.written
        msg = f"tdpipe: {why}: {n} of {total} prompts answered in {self._where()}"
        if self.path and n < total:
            msg += f"; run the same command with --resume to answer the other {total - n}"
        print(msg, file=sys.stderr)
        return code


__all__ = ["ResultSink"]
