"""The one way a bench compares: every run of every side in its own fresh process, sides alternated.

Why: an engine that runs in a process where another engine ran before is not the engine run alone.
`bench throughput --compare-pp1` once ran its pp = 1 engine after the pp = 2 one in the same process and
measured 284 output tok/s against 398 for the same settings in a process of their own (ShareGPT-like 256
requests, same sitting), which turned an honest 0.93x into a printed 1.28x. So each run here is a new
`tdpipe bench ...` process (the command it prints can be run alone) that writes its result as JSON, and
with repeats the sides run forward then backward (A B, B A, A B, ...: ABBA counterbalancing), so a machine
that drifts slower or faster over a sitting weighs on every side alike. Each side's figure is the median of
its runs (the lower middle one of an even count); a ratio is the ratio of the medians, reported with the
ratio inside each repeat (adjacent runs).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# the program a side runs: this interpreter, the CLI module (not a console script that may be absent)
CLI = [sys.executable, "-m", "tdpipe.cli"]
STOP_TIMEOUT_S = 60.0  # an interrupted comparison gives its running side this long to stop its engine


class SideFailed(ValueError):
    """A side's process failed (its own error is already on stderr); a ValueError, so the CLI prints one
    line."""


@dataclass
class SideRun:
    """One run of one side: which, in which repeat, the process that ran it and what it wrote."""

    side: str
    repeat: int
    pid: int
    wall_s: float  # the whole process: start-up, model load, warm-up and the timed run
    argv: list[str]
    result: dict[str, Any]


# -- order -----------------------------------------------------------------------------------------------
def run_order(sides: Sequence[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, side) in the order to run them: the sides forward in even repeats, backward in odd ones
    (A B B A A B ...), so no side always runs first or always follows the same neighbour."""
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    if not sides or len(set(sides)) != len(sides):
        raise ValueError(f"sides must be distinct and at least one, got {list(sides)}")
    return [(r, s) for r in range(repeats) for s in (sides if r % 2 == 0 else list(reversed(sides)))]


# -- the command of a side ---------------------------------------------------------------------------------
def _flag(act: argparse.Action) -> str:
    return next((s for s in act.option_strings if s.startswith("--")), act.option_strings[0])


def _text(v: Any) -> str:
    return ",".join(str(x) for x in v) if isinstance(v, (list, tuple)) else str(v)


def _action(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    try:
        return parser._option_string_actions[flag]
    except KeyError:
        raise ValueError(f"{parser.prog} has no option {flag}") from None


def flag_value(parser: argparse.ArgumentParser, ns: argparse.Namespace, flag: str) -> Any:
    """The parsed value of `flag` (by its name on the command line, whatever dest it is stored under)."""
    return getattr(ns, _action(parser, flag).dest)


def _default(act: argparse.Action) -> Any:
    """The value an absent option gets: argparse passes a string default through the option's type."""
    d = act.default
    return act.type(d) if isinstance(d, str) and callable(act.type) else d


def replay_flags(parser: argparse.ArgumentParser, ns: argparse.Namespace, overrides: dict[str, Any] | None = None,
                 skip: Sequence[str] = ()) -> list[str]:
    """The options that make `parser` produce `ns` with `overrides` applied ({"--pp": 1, ...}), leaving out
    the options in `skip` and every value equal to its default. Options are named as on the command line,
    so a side never depends on where argparse stores them. The list is parsed back and checked against what
    was asked, so a value that does not survive the trip fails here, naming its option, instead of quietly
    running a side with other settings."""
    want = vars(ns).copy()
    for flag, v in (overrides or {}).items():
        want[_action(parser, flag).dest] = v
    skipped = {_action(parser, f).dest for f in skip}
    out: list[str] = []
    acts = [a for a in parser._actions if a.dest not in skipped and a.dest != argparse.SUPPRESS
            and not isinstance(a, (argparse._HelpAction, argparse._VersionAction))]
    for act in acts:
        v = want.get(act.dest, _default(act))
        if v == _default(act):
            continue
        if not act.option_strings:
            raise ValueError(f"cannot replay the positional argument {act.dest!r}")
        if isinstance(act, argparse.BooleanOptionalAction):
            out.append(act.option_strings[0] if v else next(s for s in act.option_strings if s.startswith("--no-")))
        elif isinstance(act, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction)):
            out.append(_flag(act))  # differs from the default: the flag was given
        elif isinstance(act, argparse._AppendAction):
            for x in v:
                out += [_flag(act), _text(x)]
        elif act.nargs in ("*", "+") or isinstance(act.nargs, int):
            out += [_flag(act), *(_text(x) for x in v)]
        elif v is None:
            raise ValueError(f"cannot replay {_flag(act)}: None differs from its default {act.default!r}")
        else:
            out += [_flag(act), _text(v)]
    try:
        back = vars(parser.parse_args(out))
    except SystemExit:
        raise ValueError(f"the replayed options do not parse: {shlex.join(out)}") from None
    wrong = [_flag(a) for a in acts if a.option_strings and back.get(a.dest) != want.get(a.dest, _default(a))]
    if wrong:
        raise ValueError(f"cannot replay {', '.join(wrong)} faithfully (got {shlex.join(out)})")
    return out


# -- running -----------------------------------------------------------------------------------------------
def run_side(side: str, repeat: int, argv: list[str], out_path: str) -> SideRun:
    """Run `argv` (which writes its JSON to `out_path`) as a new process and read the JSON. The process's
    stdout (its own table) is dropped; its stderr (progress, warnings, errors) goes to ours."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        rc = proc.wait()
    except BaseException:  # interrupted: the side stops its engine (and stage processes) as on Ctrl-C
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    wall = time.perf_counter() - t0
    if rc != 0:
        raise SideFailed(f"side {side!r} (repeat {repeat + 1}) failed with exit code {rc}; run it alone: "
                         f"{shlex.join(argv)}")
    try:
        with open(out_path) as f:
            result = json.load(f)
    except (OSError, ValueError) as e:
        raise SideFailed(f"side {side!r} (repeat {repeat + 1}) exited 0 but left no readable JSON at {out_path} "
                         f"({e}); command: {shlex.join(argv)}") from None
    return SideRun(side, repeat, proc.pid, wall, argv, result)


Command = Callable[[str, int, str, list[SideRun]], list[str]]


def run_sides(sides: Sequence[str], repeats: int, command: Command,
              describe: Callable[[SideRun], str] | None = None) -> list[SideRun]:
    """Every (repeat, side) of run_order, one process each, one at a time. `command(side, repeat, out_path,
    runs_so_far)` gives the argv of a run that writes its JSON to out_path (runs_so_far lets a side take a
    setting from the first side's first run, which always comes first). Progress goes to stderr: which run
    starts, and when it ends `describe(run)` (e.g. its tokens/s)."""
    order = run_order(sides, repeats)
    runs: list[SideRun] = []
    with tempfile.TemporaryDirectory(prefix="tdpipe-bench-") as tmp:
        for k, (r, side) in enumerate(order):
            out = os.path.join(tmp, f"{side}.{r}.json")
            argv = command(side, r, out, runs)
            print(f"[{k + 1}/{len(order)}] {side}" + (f" (repeat {r + 1}/{repeats})" if repeats > 1 else "")
                  + ", a fresh process", file=sys.stderr, flush=True)
            run = run_side(side, r, argv, out)
            runs.append(run)
            print(f"  {side}: {describe(run) if describe else 'done'}; process {run.pid}, {run.wall_s:.1f} s "
                  "with start-up", file=sys.stderr, flush=True)
    return runs


# -- results -----------------------------------------------------------------------------------------------
def median(xs: Sequence[float]) -> float:
    """The median, the lower middle value of an even count: always one run's figure, so a side's median and
    the run whose full result the table shows agree."""
    if not xs:
        raise ValueError("no runs")
    return sorted(xs)[(len(xs) - 1) // 2]


def values(runs: Sequence[SideRun], side: str, key: Callable[[dict[str, Any]], float]) -> list[float]:
    """The metric of every run of `side`, in run order."""
    return [key(r.result) for r in runs if r.side == side]


def median_run(runs: Sequence[SideRun], side: str, key: Callable[[dict[str, Any]], float]) -> SideRun:
    """The run of `side` whose metric is the median (the lower middle one for an even count): the run whose
    full result a table shows."""
    mine = sorted((r for r in runs if r.side == side), key=lambda r: key(r.result))
    return mine[(len(mine) - 1) // 2]


def compare(runs: Sequence[SideRun], side: str, base: str, key: Callable[[dict[str, Any]], float],
            ) -> dict[str, Any]:
    """`side` against `base` on a higher-is-better metric: each one's values, median and process ids, the
    ratio of the medians and the ratio inside each repeat (both sides ran next to each other there)."""
    a, b = values(runs, side, key), values(runs, base, key)
    per_repeat = sorted({r.repeat for r in runs})
    paired = []
    for rep in per_repeat:
        x = [key(r.result) for r in runs if r.repeat == rep and r.side == side]
        y = [key(r.result) for r in runs if r.repeat == rep and r.side == base]
        if x and y and y[0]:
            paired.append(x[0] / y[0])
    ma, mb = median(a), median(b)
    return {"side": side, "base": base, "values": a, "base_values": b, "median": ma, "base_median": mb,
            "ratio": ma / mb if mb else None, "ratio_per_repeat": paired,
            "pids": [r.pid for r in runs if r.side == side],
            "base_pids": [r.pid for r in runs if r.side == base]}


def check_same_work(runs: Sequence[SideRun], key: Callable[[dict[str, Any]], Any]) -> None:
    """Every run did the same work (`key` of its result: workload, request and token counts); a ratio of
    different work is refused."""
    seen = {json.dumps(key(r.result), sort_keys=True, default=str): r for r in runs}
    if len(seen) > 1:
        (k1, r1), (k2, r2) = list(seen.items())[:2]
        raise SideFailed(f"the sides did different work: {r1.side} (repeat {r1.repeat + 1}) {k1} against "
                         f"{r2.side} (repeat {r2.repeat + 1}) {k2}")


def method(sides: Sequence[str], repeats: int, runs: Sequence[SideRun]) -> dict[str, Any]:
    """How the comparison was run, for the JSON: the order, and each run's side, process id and command."""
    return {"method": "each run in its own fresh process, one at a time; sides forward in even repeats, "
                      "backward in odd ones (ABBA); figures are medians over the repeats",
            "sides": list(sides), "repeats": repeats, "order": [f"{r.side}#{r.repeat + 1}" for r in runs],
            "runs": [{"side": r.side, "repeat": r.repeat + 1, "pid": r.pid, "wall_s": r.wall_s,
                      "command": shlex.join(r.argv)} for r in runs]}


__all__ = ["CLI", "SideFailed", "SideRun", "check_same_work", "compare", "flag_value", "median", "median_run",
           "method", "replay_flags", "run_order", "run_side", "run_sides", "values"]
