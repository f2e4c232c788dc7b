"""Tool calling on /v1/chat/completions, as vLLM serves it.

The request's `tools` reach the model's chat template (its `tools` variable). What the answer does with them
depends on `tool_choice`:
  "none"             the tools are not shown to the template (vLLM's default); a plain answer.
  "auto" (default)   the model decides; a parser named by --tool-call-parser finds its calls in the text.
                     Needs --enable-auto-tool-choice and --tool-call-parser, as in vLLM.
  "required"         the output is constrained (structured output) to a JSON array of one or more
                     {"name", "parameters"} objects, one of the tools each; no parser needed.
  {"type": "function", "function": {"name": N}}
                     the output is constrained to tool N's parameters schema: one call of N.

Parsers: `hermes` (Qwen2.5 / Qwen3, Hermes 2 Pro and the many models trained on its format): each call is
<tool_call>{"name": ..., "arguments": {...}}</tool_call>, the text before the first call is the answer's
content. A call whose JSON does not parse stays in the content, as vLLM leaves it.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from tdpipe.entrypoints.openai.errors import bad_request

TOOL_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def new_call_id() -> str:
    """vLLM's id of a tool call: chatcmpl-tool- and 32 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def call(name: str, arguments: Any) -> dict[str, Any]:
    """One tool call as OpenAI's API writes it (the arguments a JSON string)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


@dataclass
class ToolPlan:
    """What a request's tools mean for it: `mode` none | auto | required | named; `tools` for the template
    (None: not shown); `schema`: the JSON schema the output is held to (required, named)."""

    mode: str = "none"
    tools: list[dict[str, Any]] | None = None
    name: str | None = None  # the named function
    schema: dict[str, Any] | None = None
    parser: str | None = None  # auto: the parser of the answer's text (hermes, the only one)
    single: bool = False  # parallel_tool_calls false: the first call only (vLLM's rule)


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """The request's `tools`, each {"type": "function", "function": {"name", "description"?, "parameters"?}};
    a 400 naming the bad field otherwise."""
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of {\"type\": \"function\", \"function\": {...}} objects",
                          "tools", "invalid_type")
    names = set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise bad_request(f"'{where}' must be an object with \"type\": \"function\"", where, "invalid_value")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"'{where}.function' must be an object with a 'name'", f"{where}.function",
                              "invalid_value")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"'{where}.function.name' must be a non-empty string", f"{where}.function.name",
                              "invalid_value")
        if name in names:
            raise bad_request(f"'{where}.function.name': {name!r} is given twice", f"{where}.function.name",
                              "invalid_value")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"'{where}.function.parameters' must be a JSON schema object",
                              f"{where}.function.parameters", "invalid_value")
        if "description" in fn and not isinstance(fn["description"], str | None):
            raise bad_request(f"'{where}.function.description' must be a string", f"{where}.function.description",
                              "invalid_value")
    return tools


def _params(fn: dict[str, Any]) -> dict[str, Any]:
    return fn.get("parameters") or {"type": "object", "properties": {}}


def plan(tools: Any, tool_choice: Any, enable_auto: bool, parser: str | None,
         parallel_tool_calls: bool | None = None) -> ToolPlan:
    """The request's tools and tool_choice checked and resolved (vLLM's rules); a 400 naming the field.
    `parallel_tool_calls` false: at most one call ("required" holds the array to one item)."""
    p = _plan(tools, tool_choice, enable_auto, parser)
    if parallel_tool_calls is False:
        p.single = True
        if p.mode == "required" and p.schema is not None:
            p.schema = {**p.schema, "maxItems": 1}
    return p


def _plan(tools: Any, tool_choice: Any, enable_auto: bool, parser: str | None) -> ToolPlan:
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("'tool_choice' names a tool but 'tools' is empty", "tool_choice", "invalid_value")
        return ToolPlan()
    tools = check_tools(tools)
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan()
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    if choice == "auto":
        if not enable_auto or parser is None:
            raise bad_request("'tool_choice' \"auto\" (the default with tools) requires the server's "
                              "--enable-auto-tool-choice and --tool-call-parser to be set", "tool_choice",
                              "invalid_value")
        return ToolPlan("auto", tools, parser=parser)
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]},
                                                   "parameters": _params(fn)},
                  "required": ["name", "parameters"]} for n, fn in by_name.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        return ToolPlan("required", tools, schema=schema)
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                              "\"function\": {\"name\": ...}}", "tool_choice", "invalid_value")
        if name not in by_name:
            raise bad_request(f"'tool_choice.function.name': {name!r} is not one of the tools "
                              f"({', '.join(sorted(by_name))})", "tool_choice.function.name", "invalid_value")
        return ToolPlan("named", tools, name=name, schema=_params(by_name[name]))
    raise bad_request(f"'tool_choice' must be \"none\", \"auto\", \"required\" or a named function, got "
                      f"{choice!r}", "tool_choice", "invalid_value")


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls) of a hermes answer: the text before the first <tool_call> (None when empty) and each
    call whose JSON parses; with one that does not, the whole text is the content and there are no calls."""
    if TOOL_OPEN not in text:
        return text, []
    calls = [_hermes_call(body) for body in _HERMES.findall(text)]
    if not calls or None in calls:  # an opening tag without a closed call, or a call that does not parse
        return text, []
    content = text[:text.index(TOOL_OPEN)].strip()
    return content or None, calls


def _hermes_call(body: str) -> dict[str, Any] | None:
    """The call between <tool_call> and </tool_call>: {"name", "arguments"} JSON; None if it is not one."""
    try:
        obj = json.loads(body)
        return call(obj["name"], obj.get("arguments", {}))
    except (ValueError, KeyError, TypeError):
        return None


def parse_forced(plan_: ToolPlan, text: str) -> list[dict[str, Any]]:
    """The calls of a constrained answer: the named function with the text as its arguments, or the
    "required" array's items. [] where the text is not the JSON asked for (cut off by max_tokens)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return []
    if plan_.mode == "named":
        return [call(plan_.name or "", obj)]
    if not isinstance(obj, list):
        return []
    return [call(c["name"], c.get("parameters", {})) for c in obj if isinstance(c, dict) and "name" in c]


@dataclass
class HermesStream:
    """The streamed form of parse_hermes: text in, (content delta, finished calls) out. Content flows until
    the first <tool_call> (a trailing prefix of the tag is held back until the next text decides); each call
    is sent whole once its </tool_call> arrives; text between and after calls is dropped, as parse_hermes
    drops it. finish() returns what is still held that is content: a call left open, or a held tag prefix."""

    held: str = ""
    in_call: bool = False
    started: bool = False  # a <tool_call> has begun: no more content
    calls: int = 0

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        self.held += delta
        content, out = "", []
        while True:
            if not self.in_call:
                i = self.held.find(TOOL_OPEN)
                if i < 0:
                    cut = len(self.held) - partial_suffix(self.held, TOOL_OPEN)
                    if not self.started:
                        content += self.held[:cut]
                    self.held = self.held[cut:]
                    return content, out
                if not self.started:
                    content += self.held[:i]
                self.held, self.in_call, self.started = self.held[i:], True, True
            j = self.held.find(_CLOSE)
            if j < 0:
                return content, out
            found = _hermes_call(self.held[len(TOOL_OPEN):j])
            if found is None:
                content += self.held[:j + len(_CLOSE)]  # not a call: its text stays the answer's
            else:
                out.append(found)
                self.calls += 1
            self.held, self.in_call = self.held[j + len(_CLOSE):], False

    def finish(self) -> str:
        held, self.held = self.held, ""
        return held if self.in_call or not self.started else ""


def partial_suffix(text: str, tag: str) -> int:
    """How many trailing characters of `text` could begin `tag` (held back until the next delta decides;
    reasoning.py holds its markers back with it too)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


__all__ = ["TOOL_OPEN", "HermesStream", "ToolPlan", "call", "check_tools", "new_call_id", "parse_forced",
           "parse_hermes", "partial_suffix", "plan"]
