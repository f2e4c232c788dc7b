"""A dataclass field that declares its command-line flag beside its default and help, so the flags are derived
from the dataclass (EngineArgs, a policy's knobs) and never declared a second time.

`option(default, help, "--flag")` is a `dataclasses.field` whose metadata carries the flag; `add_flags` adds
the flags of a dataclass to an argparse parser (or group), with the field's name as the dest and its default
as the flag's default; `from_namespace` reads them back. Standard library only: the policies (core) declare
their knobs with it, the command line (entrypoints) reads them.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any, Callable

Text = str | Callable[[], str]  # a help text, or a function that writes it when the parser is built


def option(default: Any, help: Text, *flags: str, type: Callable[[str], Any] | None = None,
           metavar: str | None = None, choices: Callable[[], Any] | Any = None, action: str | None = None,
           group: str = "engine", shown: Callable[[Any], str] | None = None) -> Any:
    """A field with a default and its flag. No flags: a keyword of the dataclass only (no command-line flag).

    action: None (a value), "negate" (`--no-x` turns a True bool off), "bool" (`--x` / `--no-x`).
    metavar: default the first flag's name in capitals (argparse would use the field's name).
    choices: a collection, or a function giving one when the parser is built (the registered policies).
    group: which argument group of the command shows the flag ("" for the command's own options).
    shown: how the default is written for argparse (parsed back through `type`, e.g. "32,1024").
    """
    meta = {"flags": flags, "help": help, "type": type, "metavar": metavar, "choices": choices, "action": action,
            "group": group, "shown": shown}
    return dataclasses.field(default=default, metadata=meta)


def json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object value ('{"temperature": 0.5}'); a usage error otherwise."""
    try:
        v = json.loads(text)
    except ValueError:
        v = None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, such as '{{\"temperature\": 0.5}}', got {text!r}")
    return v


def flagged(cls: type) -> list[dataclasses.Field]:
    """The fields of a dataclass that have a command-line flag, in declaration order."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("flags")]


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise ValueError(f"{f.name} has no default")


def add_flag(g: argparse._ActionsContainer, f: dataclasses.Field, default: Any = dataclasses.MISSING) -> None:
    """Add one field's flag to a parser or group (`default`: the command's own default, if not the field's)."""
    m = f.metadata
    value = default_of(f) if default is dataclasses.MISSING else default
    text = m["help"]() if callable(m["help"]) else m["help"]
    kw: dict[str, Any] = {"dest": f.name, "help": text}
    if m["action"] == "negate":
        kw.update(action="store_false", default=value)
    elif m["action"] == "bool":
        kw.update(action=argparse.BooleanOptionalAction, default=value)
    else:
        choices = m["choices"]() if callable(m["choices"]) else m["choices"]
        kw["default"] = m["shown"](value) if m["shown"] and value is not None else value
        if m["type"] is not None:
            kw["type"] = m["type"]
        if choices is not None:
            kw["choices"] = choices
        else:
            kw["metavar"] = m["metavar"] or m["flags"][0].lstrip("-").replace("-", "_").upper()
    g.add_argument(*m["flags"], **kw)


def add_flags(g: argparse._ActionsContainer, cls: type) -> None:
    """Every flag of a dataclass, into one parser or group."""
    for f in flagged(cls):
        add_flag(g, f)


def from_namespace(cls: type, ns: argparse.Namespace) -> dict[str, Any]:
    """The values the parsed command line gives the dataclass's flagged fields (those the parser has)."""
    return {f.name: getattr(ns, f.name) for f in flagged(cls) if hasattr(ns, f.name)}


__all__ = ["add_flag", "add_flags", "default_of", "flagged", "from_namespace", "option"]
