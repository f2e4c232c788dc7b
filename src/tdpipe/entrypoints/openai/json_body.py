"""Strict JSON for request bodies: whatever a client sends is a 400 naming what is wrong, never a 500.

json.loads accepts more than the server can use: NaN and Infinity literals, integers of any length (Python
refuses past 4,300 digits with a ValueError), nesting as deep as the parser's recursion, and `\\ud800`-style
escapes that leave an unpaired UTF-16 surrogate in a string. Such a string is not Unicode text: the tokenizer
refuses it with a TypeError and no response can encode it as UTF-8, so it is refused here, with where it was.
"""
from __future__ import annotations

import json
import re
from typing import Any

from tdpipe.entrypoints.openai.errors import bad_request
from tdpipe.tokenizer import lone_surrogate

MAX_JSON_DEPTH = 64  # nesting deeper than any OpenAI body needs is a 400, before anything walks it
# an escape of a surrogate code point (U+D800-U+DFFF): the only way one can reach a string, since the body was
# decoded as UTF-8 first, which has none; paired ones become one code point in json.loads
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(text: str) -> Any:
    """Strict JSON as a 400, never a 500: no NaN or Infinity literals, integers of at most 4300 digits
    (Python's limit). Nesting too deep for the parser is a 400 here; the caller checks MAX_JSON_DEPTH with
    depth_over, and unpaired surrogates with lone_surrogate_at where may_hold_surrogates(text)."""
    try:
        obj = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise bad_request(f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)",
                          code="invalid_json") from None
    except ValueError as e:  # a NaN literal, an integer with too many digits
        raise bad_request(f"the request body is not valid JSON: {str(e).split(';')[0]}",
                          code="invalid_json") from None
    return obj


def depth_over(obj: Any, limit: int) -> bool:
    """Whether containers nest deeper than `limit`. Iterative (a deep value cannot exhaust the stack), and
    depth-first with one iterator per open level, so that it holds at most `limit` objects: a breadth of
    100,000 messages queued as tuples would wake the garbage collector's full collections, which freeze the
    event loop as well."""
    if not isinstance(obj, (dict, list)):
        return False
    open_levels = [iter(obj.values() if isinstance(obj, dict) else obj)]
    while open_levels:
        for child in open_levels[-1]:
            if isinstance(child, (dict, list)):
                if len(open_levels) >= limit:
                    return True
                open_levels.append(iter(child.values() if isinstance(child, dict) else child))
                break
        else:
            open_levels.pop()
    return False


def may_hold_surrogates(text: str) -> bool:
    """Whether the raw body escapes a surrogate code point at all (a cheap test before lone_surrogate_at)."""
    return _SURROGATE_ESCAPE.search(text) is not None


def lone_surrogate_at(obj: Any) -> str | None:
    """Where the first string or object key holding an unpaired surrogate is, as a field path
    ('messages[0].content', with the key itself escaped where it is the bad string), or None. Iterative, like
    depth_over, on a body already known to nest at most MAX_JSON_DEPTH deep."""
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if lone_surrogate(value) is not None:
                return path or "the body"
        elif isinstance(value, dict):
            for key, child in reversed(list(value.items())):
                if lone_surrogate(key) is not None:
                    name = key.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")
                    return f"the field name '{name}'" + (f" in {path}" if path else "")
                stack.append((f"{path}.{key}" if path else key, child))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", child) for i, child in reversed(list(enumerate(value))))
    return None


def surrogate_error(where: str):
    """The 400 for an unpaired surrogate at `where` (lone_surrogate_at's answer)."""
    param = None if where.startswith("the ") else where
    return bad_request(f"{where} holds an unpaired UTF-16 surrogate (a \\uD800-\\uDFFF escape without its "
                       "pair), which is not Unicode text", param=param, code="invalid_encoding")
