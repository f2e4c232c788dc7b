"""Checks a chat conversation before the template sees it, so a malformed one fails as its own request with
a message that names the message and field, instead of a template error (or a crash) for the whole batch;
and the form templates expect of an assistant's earlier tool calls (their arguments as objects)."""
from __future__ import annotations

import json
from typing import Any

from tdpipe.tokenizer import require_unicode

# the roles of the OpenAI chat API; a template may know fewer, none knows others
ROLES = ("system", "developer", "user", "assistant", "tool")


def check_conversation(conv: Any) -> list[dict[str, Any]]:
    """Return `conv` if it is a non-empty list of {"role": one of ROLES, "content": str}; else ValueError. An
    assistant message that only calls tools ("tool_calls") may have content None."""
    if not isinstance(conv, list) or not conv:
        raise ValueError(f"a conversation must be a non-empty list of messages, got {type(conv).__name__}"
                         + (" (empty)" if isinstance(conv, list) else ""))
    for i, m in enumerate(conv):
        if not isinstance(m, dict):
            raise ValueError(f"message {i}: expected an object with 'role' and 'content', got {type(m).__name__}")
        for k in ("role", "content"):
            if k not in m:
                raise ValueError(f"message {i}: missing '{k}'")
        if m["role"] not in ROLES:
            raise ValueError(f"message {i}: unknown role {m['role']!r} (expected one of {', '.join(ROLES)})")
        if m["content"] is None and m.get("tool_calls"):
            continue
        if not isinstance(m["content"], str):
            raise ValueError(f"message {i}: 'content' must be a string, got {type(m['content']).__name__}")
        require_unicode(m["content"], f"message {i}: 'content'")
    return conv


def template_conversation(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for the chat template: an assistant message's tool-call arguments as objects (templates
    write them with tojson; a JSON string would be quoted twice), as vLLM passes them."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = dict(m)
            m["tool_calls"] = [_template_call(c) for c in calls]
        out.append(m)
    return out


def _template_call(c: dict[str, Any]) -> dict[str, Any]:
    fn = dict(c.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args)
        except ValueError:
            pass
    return {**c, "function": fn}


__all__ = ["ROLES", "check_conversation", "template_conversation"]
