"""The OpenAI Batch file format as `tdpipe run-batch` reads and writes it, and the output file that makes a
run resumable.

In: one request per line, `{"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions",
"body"}`. Out: one line per input line, `{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}`: a request the server answered (200 or 4xx: the body is its response or its OpenAI error
object) has `response`; a line that cannot be sent at all (not JSON, no custom_id, a duplicate custom_id, a
bad method or url) has `response: null` and `error: {"code", "message", "line"}`.

Every input line has a key that its output line carries back, so a second run knows what the first finished:
the custom_id, or the line number for a line without a usable one (not JSON, no custom_id, a later duplicate).
"""
from __future__ import annotations

import json
import os
import sys
import uuid
from dataclasses import dataclass
from typing import Any

from tdpipe.entrypoints.openai.json_body import lone_surrogate_at, surrogate_error
from tdpipe.entrypoints.preflight import PreflightError
from tdpipe.entrypoints.results import jsonl_bytes

URLS = ("/v1/completions", "/v1/chat/completions")
Key = tuple[str, Any]  # ("id", custom_id) or ("line", line number)


@dataclass
class BatchLine:
    """One non-blank input line: a request to send, or an error to report without sending anything."""

    line: int  # 1-based line number in the input file
    key: Key
    custom_id: str | None = None
    url: str = ""
    body: Any = None
    error: dict[str, Any] | None = None  # {"code", "message", "line"}: nothing is sent
    refusal: dict[str, Any] | None = None  # an OpenAI error body: answered 400 without reaching the engine


def parse_batch(data: bytes) -> list[BatchLine]:
    """Every non-blank line of an input file, in order. Never raises: each bad line becomes an error line."""
    out: list[BatchLine] = []
    seen: set[str] = set()
    for n, raw in enumerate(data.split(b"\n"), 1):
        raw = raw.rstrip(b"\r")
        if not raw.strip():
            continue
        out.append(_parse_line(raw, n, seen))
    return out


def _line_error(n: int, code: str, message: str, custom_id: str | None = None,
                by_id: bool = False) -> BatchLine:
    key: Key = ("id", custom_id) if by_id else ("line", n)
    return BatchLine(n, key, custom_id, error={"code": code, "message": f"line {n}: {message}", "line": n})


def _parse_line(raw: bytes, n: int, seen: set[str]) -> BatchLine:
    try:
        rec = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return _line_error(n, "invalid_json", f"not valid UTF-8 (byte {e.start})")
    except json.JSONDecodeError as e:
        return _line_error(n, "invalid_json", f"not valid JSON: {e}")
    if not isinstance(rec, dict):
        return _line_error(n, "invalid_json", f"expected a JSON object, got {type(rec).__name__}")
    cid = rec.get("custom_id")
    if not isinstance(cid, str) or not cid:
        what = "has no 'custom_id'" if cid is None else f"'custom_id' must be a non-empty string, got {cid!r}"
        return _line_error(n, "invalid_custom_id", what)
    if lone_surrogate_at(cid) is not None:  # not Unicode text: it could not be written back
        return _line_error(n, "invalid_custom_id", surrogate_error("'custom_id'").message)
    if cid in seen:
        return _line_error(n, "duplicate_custom_id", f"custom_id {cid!r} appears on an earlier line; "
                           "custom_ids must be unique in a batch", cid)
    seen.add(cid)
    method = rec.get("method", "POST")
    if method != "POST":
        return _line_error(n, "invalid_method", f"'method' must be \"POST\", got {method!r}", cid, by_id=True)
    url = rec.get("url")
    if url not in URLS:
        return _line_error(n, "invalid_url", f"'url' must be one of {', '.join(URLS)}; got {url!r}", cid,
                           by_id=True)
    body = rec.get("body")
    bl = BatchLine(n, ("id", cid), cid, url, body)
    if not isinstance(body, dict):
        what = "is missing" if body is None else f"must be a JSON object, got {type(body).__name__}"
        bl.refusal = _error_body(f"line {n}: 'body' {what}", "body", "invalid_request")
    elif body.get("stream") not in (None, False):
        bl.refusal = _error_body(f"line {n}: 'stream': a batch request is not streamed; remove 'stream' or "
                                 "set it to false", "stream", "unsupported_parameter")
    elif (where := lone_surrogate_at(body)) is not None:  # the server's 400 (it could not be sent as UTF-8)
        e = surrogate_error(where)
        bl.refusal = _error_body(f"line {n}: body: {e.message}", e.param or "body", e.code)
    return bl


def _error_body(message: str, param: str, code: str) -> dict[str, Any]:
    """The OpenAI error object, as the server's own 400s carry it."""
    from tdpipe.entrypoints.openai.errors import error_body

    return error_body(400, message, param, code)


# -- output lines ------------------------------------------------------------------------------------------
def response_record(custom_id: str, status_code: int, body: Any) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": f"req_{uuid.uuid4().hex}", "body": body},
            "error": None}


def error_record(bl: BatchLine) -> dict[str, Any]:
    """The output line of an input line that was not sent: its error, or its 400 refusal."""
    if bl.refusal is not None:
        return response_record(bl.custom_id or "", 400, bl.refusal)
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": bl.custom_id, "response": None,
            "error": bl.error}


def record_key(rec: Any) -> Key:
    """The input key an output line answers (ValueError if it is not a batch output line)."""
    if not isinstance(rec, dict) or "custom_id" not in rec or not ("response" in rec or "error" in rec):
        raise ValueError("not a batch output line")
    err, cid = rec.get("error"), rec["custom_id"]
    if isinstance(err, dict) and (cid is None or err.get("code") == "duplicate_custom_id"):
        if type(err.get("line")) is not int:
            raise ValueError("an error line without its line number")
        return ("line", err["line"])
    if not isinstance(cid, str):
        raise ValueError("custom_id is not a string")
    return ("id", cid)


def failed(rec: dict[str, Any]) -> bool:
    resp = rec.get("response")
    return rec.get("error") is not None or not isinstance(resp, dict) or resp.get("status_code") != 200


def describe(key: Key) -> str:
    return f"custom_id {key[1]!r}" if key[0] == "id" else f"the error for input line {key[1]}"


# -- the output file ---------------------------------------------------------------------------------------
class BatchSink:
    """The output file, opened for appending. What an earlier run left there is `done` (a line cut by a kill
    is dropped first); each new line is written whole with one os.write loop on an O_APPEND descriptor, so a
    crash at any moment leaves whole lines and at most one cut last line."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.done: set[Key] = set()
        self.prev_failed = 0
        self.written = 0
        self.failed = 0
        self.fd = -1
        self.write_failed = False
        self.cut_at: int | None = None
        if os.path.isfile(path):  # not a device or a pipe (/dev/null): nothing to read back there
            self._read_existing()

    def _read_existing(self) -> None:
        with open(self.path, "rb") as f:
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.cut_at = end if end < len(data) else None  # dropped once the run starts writing
        for n, raw in enumerate(data[:end].split(b"\n")[:-1], 1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
                key = record_key(rec)
            except ValueError:
                raise PreflightError(f"--output-file {self.path}: line {n} is not a batch output line "
                                     "(id, custom_id, response, error); not resuming into it") from None
            self.done.add(key)
            self.prev_failed += failed(rec)

    def check_input(self, lines: list[BatchLine], input_path: str) -> None:
        """Refuse an output file written for another batch: every key in it must be one of the input's."""
        keys = {bl.key for bl in lines}
        stray = next((k for k in self.done if k not in keys), None)
        if stray is not None:
            raise PreflightError(f"--output-file {self.path} has {describe(stray)}, which is not in "
                                 f"{input_path}; it was written for another batch (use a new output file)")

    def __enter__(self) -> "BatchSink":
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if self.cut_at is not None:
            print(f"tdpipe: {self.path}: dropping its cut last line (a write that was interrupted); that "
                  "request runs again", file=sys.stderr)
            os.ftruncate(self.fd, self.cut_at)
            self.cut_at = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def write(self, rec: dict[str, Any]) -> None:
        """One whole line; a write that fails part-way (disk full) is cut back, so a rerun resumes cleanly."""
        data = jsonl_bytes(rec)
        start = os.fstat(self.fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view):]
        except OSError:
            self.write_failed = True
            try:
                os.ftruncate(self.fd, start)
            except OSError:
                pass
            raise
        self.written += 1
        self.failed += failed(rec)

    @property
    def total_done(self) -> int:
        return len(self.done) + self.written

    @property
    def total_failed(self) -> int:
        return self.prev_failed + self.failed


__all__ = ["BatchLine", "BatchSink", "URLS", "error_record", "failed", "parse_batch", "record_key",
           "response_record"]
