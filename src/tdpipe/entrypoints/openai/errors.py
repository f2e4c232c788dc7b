"""OpenAI's error object and the HTTP status of each failure, so clients (the `openai` package among them)
raise the right exception class with a message that names the bad field."""
from __future__ import annotations

import json
import re
from typing import Any

from pydantic import ValidationError

from tdpipe.core.engine_client import EngineDeadError
from tdpipe.core.validation import RequestError, field_of

__all__ = ["EngineDeadError", "OpenAIError", "bad_request", "engine_dead", "error_body", "error_json",
           "from_request_error", "from_sampling_error", "from_validation_error"]

# OpenAI's "type" for each status (what its own API returns)
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          408: "invalid_request_error",
          413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
          500: "internal_server_error", 503: "service_unavailable_error"}


class OpenAIError(Exception):
    """A request that fails with an OpenAI error body. `param` names the offending field (None when the
    failure is not about one field)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


def error_json(status: int, message: str, param: str | None = None, code: str | None = None) -> str:
    return json.dumps(error_body(status, message, param, code))


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param, code)


# pydantic's names for the members of a union ("str", "list[int]", "function-after[...]"): not field names
_UNION_TAG = re.compile(r"[\[\]]|^(str|int|float|bool|list|dict|none|null)$")


def _param(loc: tuple[Any, ...]) -> str | None:
    """('messages', 2, 'role') -> 'messages[2].role'; union member tags dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _UNION_TAG.search(str(part)):
            out += ("." if out else "") + str(part)
    return out or None


def from_validation_error(e: ValidationError, prefix: tuple[Any, ...] = ()) -> OpenAIError:
    """The first pydantic error as a 400 naming the field (the others follow in the message); `prefix` is
    where the validated object sits in the request (("messages", 2) for one message)."""
    errors = e.errors(include_url=False)
    first = errors[0]
    param = _param(prefix + tuple(first["loc"]))
    if first["type"] == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first['msg']}", code="invalid_json")
    if first["type"] == "model_type" and param is None:
        return bad_request("the request body must be a JSON object", code="invalid_json")
    if first["type"] == "missing":
        return bad_request(f"'{param}' is a required field", param, "missing_required_parameter")
    msg = f"Invalid value for '{param}': {first['msg'].rstrip('.')}" if param else first["msg"]
    if "input" in first and first["type"] != "value_error":
        msg += f" (got {_short(first['input'])})"
    others = {_param(prefix + tuple(x["loc"])) for x in errors[1:]} - {param, None}
    if others:
        msg += f"; also invalid: {', '.join(sorted(others))}"
    return bad_request(msg, param, "invalid_value" if first["type"] == "value_error" else "invalid_type")


def _short(v: Any) -> str:
    s = json.dumps(v) if isinstance(v, (str, int, float, bool, list, dict, type(None))) else repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def from_sampling_error(e: ValueError, rename: dict[str, str] | None = None) -> OpenAIError:
    """SamplingParams' ValueError ('temperature must be >= 0, got -1.0') as a 400 whose param is the field
    its message starts with, under the name the request used (`rename`: max_tokens ->
    max_completion_tokens)."""
    msg = str(e)
    param = field_of(msg)
    rename = rename or {}
    if param in rename:
        msg = rename[param] + msg[len(param):]
        param = rename[param]
    return bad_request(msg, param, "invalid_value")


def from_request_error(e: RequestError) -> OpenAIError:
    """core/validation.py's RequestError (it already names the field the route uses) as a 400."""
    return bad_request(str(e), e.param, e.code)


def engine_dead(e: BaseException | str) -> OpenAIError:
    return OpenAIError(503, f"the engine is not running: {e}", code="engine_dead",
                       headers={"Retry-After": "5"})
