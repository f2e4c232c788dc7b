"""Checks a chat conversation before the template sees it, so a malformed one fails as its own request with
a message that names the message and field, instead of a template error (or a crash) for the whole batch."""
from __future__ import annotations

from typing import Any

from tdpipe.tokenizer import require_unicode

# the roles of the OpenAI chat API; a template may know fewer, none knows others
ROLES = ("system", "developer", "user", "assistant", "tool")


def check_conversation(conv: Any) -> list[dict[str, str]]:
    """Return `conv` if it is a non-empty list of {"role": one of ROLES, "content": str}; else ValueError."""
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
        if not isinstance(m["content"], str):
            raise ValueError(f"message {i}: 'content' must be a string, got {type(m['content']).__name__}")
        require_unicode(m["content"], f"message {i}: 'content'")
    return conv


__all__ = ["ROLES", "check_conversation"]
