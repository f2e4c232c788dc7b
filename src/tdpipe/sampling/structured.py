"""What a request's output must look like (vLLM's StructuredOutputsParams, same field names): a JSON schema,
any JSON object, a regular expression, one of a list of choices, or an EBNF grammar.

This module only describes the constraint and checks its shape (no xgrammar here); sampling/grammar.py parses,
compiles and follows it: its `parse_grammar` needs no tokenizer, so a frontend refuses a bad schema or regex (a
400 naming it) before the request reaches the engine.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

# The kinds, in the order vLLM checks them; exactly one is set per request.
KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_SPEC_CHARS = 1 << 20
ANY_OBJECT = '{"type": "object", "additionalProperties": true}'  # json_object: OpenAI's "a JSON object"  # a schema, regex or grammar larger than this is refused before it is parsed


@dataclass
class StructuredOutputsParams:
    """`json`: a JSON schema (dict or JSON text); `regex`: a regular expression; `choice`: the answer is one
    of these strings; `grammar`: an EBNF (GBNF) grammar with a `root` rule; `json_object`: any JSON object.
    `disable_any_whitespace`: JSON without free whitespace between tokens (vLLM's flag; xgrammar then writes
    one space after ',' and ':'), which keeps small models at high temperature from wandering off in blank
    space. As in vLLM with xgrammar, a schema's objects take only the properties it lists unless it says
    `additionalProperties` (xgrammar's strict mode)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError("structured_outputs must set exactly one of " + ", ".join(KINDS) +
                             (f"; got {', '.join(set_kinds)}" if set_kinds else "; got none"))
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured_outputs.disable_any_whitespace must be a bool, got "
                             f"{self.disable_any_whitespace!r}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object or its JSON text), got "
                             f"{type(self.json).__name__}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {v!r}"[:200])
        if self.choice is not None:
            ok = isinstance(self.choice, (list, tuple)) and self.choice and all(
                isinstance(c, str) for c in self.choice)
            if not ok:
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            self.choice = list(self.choice)
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be true when set, got {self.json_object!r}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs.{self.kind} is {len(self.spec)} characters; at most "
                             f"{MAX_SPEC_CHARS} are allowed")

    @classmethod
    def of(cls, value: "StructuredOutputsParams | dict[str, Any]") -> "StructuredOutputsParams":
        """A dict with the same keys is accepted too (vLLM's `extra_body={"structured_outputs": {...}}`)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict, got "
                             f"{type(value).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(k for k in value if k not in names)
        if unknown:
            raise ValueError(f"structured_outputs has unknown field {str(unknown[0])[:60]!r}; the fields are "
                             + ", ".join(sorted(names)))
        return cls(**value)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as one string: with `kind` and the flag, the cache key of its compiled grammar."""
        if self.json is not None:
            return self.json if isinstance(self.json, str) else json.dumps(self.json)  # key order: property order
        if self.choice is not None:
            return json.dumps(self.choice)
        return self.regex or self.grammar or ""

    @property
    def key(self) -> tuple:
        return (self.kind, self.spec, self.disable_any_whitespace)

    def grammar_source(self) -> tuple[str, str]:
        """(how xgrammar reads it, text): choices become a regex of their escaped alternatives."""
        if self.choice is not None:
            import re

            return "regex", "(" + "|".join(re.escape(c) for c in self.choice) + ")"
        if self.json_object:  # any object (xgrammar's built-in JSON grammar also takes arrays and scalars)
            return "json", ANY_OBJECT
        return self.kind, self.spec


__all__ = ["KINDS", "MAX_SPEC_CHARS", "StructuredOutputsParams"]
