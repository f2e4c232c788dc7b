"""Checks that run before a model is loaded, so an unwritable output or a missing input fails in a second,
not after an hour of generation (and never throws finished work away)."""
from __future__ import annotations

import os


class PreflightError(SystemExit):
    """An ordinary user mistake found before any work started: one line, exit code 2."""

    def __init__(self, msg: str) -> None:
        super().__init__(2)
        self.msg = msg

    def __str__(self) -> str:
        return self.msg


def check_writable(path: str | None, flag: str) -> None:
    """Fail now if `path` (given with `flag`, e.g. '--json') cannot be created or appended to. Creates
    nothing: a missing directory, a directory in the way, or no permission is reported with the flag."""
    if not path or path == "-" or path == os.devnull:
        return
    if os.path.isdir(path):
        raise PreflightError(f"{flag} {path}: is a directory")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise PreflightError(f"{flag} {path}: directory {parent} does not exist")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise PreflightError(f"{flag} {path}: not writable")
    elif not os.access(parent, os.W_OK | os.X_OK):
        raise PreflightError(f"{flag} {path}: cannot create a file in {parent}")


def check_model(model: str | None, flag: str = "--model") -> None:
    """Fail now if `model` names neither a local folder / .gguf file nor a known `random:NAME` config."""
    if not model:
        return
    if model.startswith("random:"):
        from tdpipe.model.random_model import PREFIX, known_configs

        if model.removeprefix(PREFIX) not in known_configs():
            raise PreflightError(f"{flag} {model}: unknown random model; known: "
                                 f"{', '.join(PREFIX + n for n in known_configs())}")
        return
    if not os.path.exists(os.path.expanduser(model)):
        raise PreflightError(f"{flag} {model}: no such file or directory (tdpipe reads a local model folder, a "
                             ".gguf file or random:NAME; it never downloads from a hub)")


def check_readable(path: str | None, flag: str) -> None:
    """Fail now if an input file named by `flag` is missing or unreadable."""
    if not path or path == "-":
        return
    if not os.path.exists(path):
        raise PreflightError(f"{flag} {path}: no such file")
    if os.path.isdir(path):
        raise PreflightError(f"{flag} {path}: is a directory, expected a file")
    if not os.access(path, os.R_OK):
        raise PreflightError(f"{flag} {path}: not readable")


__all__ = ["PreflightError", "check_readable", "check_writable"]
