"""Trace analysis and the timeline picture of the pipeline-parallel runtime.

The runtime writes a JSON trace (format ``tdpipe-trace/1``)::

    {"format": "tdpipe-trace/1", "pp": 2, "policy": "separate", "machine": "...",
     "stages": [{"stage": 0, "layers": [0, 18], "threads": 1,
                 "events": [{"batch_id": 0, "start": 0.010, "end": 0.050, "wait": 0.002, "send": 0.001,
                             "prefill_tokens": 512, "decode_seqs": 0}, ...]}, ...],
     "engine": [{"batch_id": 0, "submit": 0.001, "done": 0.09}, ...],
     "kv": [[0.0, 0.0], [0.09, 0.12], ...]}

Times are seconds since the start of the trace. ``[start, end]`` of an event is the stage's compute;
``wait`` is the idle time waiting for the input right before ``start``; ``send`` is the time spent sending
the output after ``end`` (on a sender thread, so it may overlap the next compute). ``layers`` is the
half-open range ``[first, last + 1)`` of decoder layers the stage holds. ``kv`` is ``[time, fraction of
KV blocks used]``.

Bubble ratio of a stage = idle time / wall time, where wall is ``[first event start, last event end]``
over all stages and busy time is the union of the stage's compute intervals (so overlapping events, e.g.
from several compute threads, count once). This is the quantity TD-Pipe (Fig. 2) shows as the white gaps
in the per-stage Gantt chart; its Fig. 12 shows the KV cache usage over time, our bottom panel.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any

TRACE_FORMAT = "tdpipe-trace/1"

KIND_COLORS = {"prefill": "#1f77b4", "decode": "#ff7f0e", "mixed": "#2ca02c", "other": "#7f7f7f"}


# --------------------------------------------------------------------------------------------------- loading

def _num(x: Any, where: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise ValueError(f"{where} must be a finite number, got {x!r}")
    return float(x)


def validate_trace(trace: Any) -> dict:
    """Check the structure of a trace dict; raise ValueError naming the first problem. Returns the trace."""
    if not isinstance(trace, dict):
        raise ValueError(f"a trace must be a JSON object, got {type(trace).__name__}")
    fmt = trace.get("format")
    if fmt != TRACE_FORMAT:
        raise ValueError(f"unsupported trace format {fmt!r} (expected {TRACE_FORMAT!r})")
    stages = trace.get("stages")
    if not isinstance(stages, list) or not stages:
        raise ValueError("trace field 'stages' must be a non-empty list")
    for i, st in enumerate(stages):
        if not isinstance(st, dict):
            raise ValueError(f"stages[{i}] must be an object")
        evs = st.get("events", [])
        if not isinstance(evs, list):
            raise ValueError(f"stages[{i}].events must be a list")
        layers = st.get("layers")
        if layers is not None and not (isinstance(layers, list) and len(layers) == 2
                                       and all(isinstance(x, int) for x in layers)):
            raise ValueError(f"stages[{i}].layers must be [first, end), got {layers!r}")
        for j, ev in enumerate(evs):
            where = f"stages[{i}].events[{j}]"
            if not isinstance(ev, dict):
                raise ValueError(f"{where} must be an object")
            for k in ("start", "end"):
                if k not in ev:
                    raise ValueError(f"{where} has no '{k}'")
            s, e = _num(ev["start"], f"{where}.start"), _num(ev["end"], f"{where}.end")
            if e < s:
                raise ValueError(f"{where} ends before it starts ({s} > {e})")
            for k in ("wait", "send", "prefill_tokens", "decode_seqs"):
                if k in ev and _num(ev[k], f"{where}.{k}") < 0:
                    raise ValueError(f"{where}.{k} must be >= 0, got {ev[k]!r}")
    for k in ("engine", "kv"):
        if trace.get(k) is not None and not isinstance(trace[k], list):
            raise ValueError(f"trace field '{k}' must be a list")
    for j, pt in enumerate(trace.get("kv") or []):
        if not (isinstance(pt, (list, tuple)) and len(pt) == 2):
            raise ValueError(f"kv[{j}] must be [time, fraction], got {pt!r}")
        _num(pt[0], f"kv[{j}] time")
        _num(pt[1], f"kv[{j}] fraction")
    return trace


def load_trace(path: str | os.PathLike) -> dict:
    """Read and validate a ``tdpipe-trace/1`` JSON file. Raises FileNotFoundError if it is missing and
    ValueError (naming the problem) if it is not JSON or not a valid trace."""
    with open(path) as f:
        text = f.read()
    try:
        trace = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{os.fspath(path)} is not valid JSON: {e}") from None
    try:
        return validate_trace(trace)
    except ValueError as e:
        raise ValueError(f"{os.fspath(path)}: {e}") from None


# --------------------------------------------------------------------------------------------------- analysis

def event_kind(ev: dict) -> str:
    """'prefill' (prompt tokens only), 'decode' (decoding sequences only), 'mixed' (both), or 'other'
    (neither recorded)."""
    p, d = ev.get("prefill_tokens", 0) or 0, ev.get("decode_seqs", 0) or 0
    if p > 0 and d > 0:
        return "mixed"
    if p > 0:
        return "prefill"
    if d > 0:
        return "decode"
    return "other"


def _union_length(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of the intervals clipped to [lo, hi]."""
    clipped = sorted((max(s, lo), min(e, hi)) for s, e in intervals if min(e, hi) > max(s, lo))
    total, cur_s, cur_e = 0.0, None, None
    for s, e in clipped:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        elif e > cur_e:
            cur_e = e
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def _stage_intervals(trace: dict) -> list[list[tuple[float, float]]]:
    return [[(float(ev["start"]), float(ev["end"])) for ev in st.get("events", [])] for st in trace["stages"]]


def wall_window(trace: dict) -> tuple[float, float]:
    """[min event start, max event end] over all stages. ValueError if the trace has no events or the
    window has zero length."""
    ivs = [iv for st in _stage_intervals(trace) for iv in st]
    if not ivs:
        raise ValueError("the trace has no events")
    lo, hi = min(s for s, _ in ivs), max(e for _, e in ivs)
    if hi <= lo:
        raise ValueError(f"the trace spans no time (all events at t={lo})")
    return lo, hi


def _ratios(trace: dict, lo: float, hi: float) -> list[float]:
    wall = hi - lo
    return [max(0.0, 1.0 - _union_length(ivs, lo, hi) / wall) for ivs in _stage_intervals(trace)]


def bubble_ratios(trace: dict) -> list[float]:
    """Per stage: idle / wall time over the window [first event start, last event end] of all stages.

    Busy time is the union of the stage's [start, end] intervals (overlaps count once). A stage with no
    events is idle the whole window, so its ratio is 1.0. A trace without events (or spanning zero time)
    raises ValueError."""
    lo, hi = wall_window(trace)
    return _ratios(trace, lo, hi)


def decode_window(trace: dict) -> tuple[float, float] | None:
    """The decode-only window: from the latest end of any event with prefill_tokens > 0 (over all stages;
    the first start if there is none) to the last end. None if it is empty or no event overlaps it."""
    evs = [ev for st in trace["stages"] for ev in st.get("events", [])]
    if not evs:
        return None
    hi = max(float(ev["end"]) for ev in evs)
    pre = [float(ev["end"]) for ev in evs if (ev.get("prefill_tokens", 0) or 0) > 0]
    lo = max(pre) if pre else min(float(ev["start"]) for ev in evs)
    if hi <= lo or not any(min(float(ev["end"]), hi) > max(float(ev["start"]), lo) for ev in evs):
        return None
    return lo, hi


def decode_bubble_ratios(trace: dict) -> list[float] | None:
    """Like bubble_ratios, but over the decode-only window (see decode_window); None if there is none."""
    w = decode_window(trace)
    return None if w is None else _ratios(trace, *w)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def summarize(trace: dict) -> dict:
    """Numbers of a trace: bubble ratios (overall and decode-only window, per stage and mean over stages),
    wall time, and per stage micro-batch count, busy seconds, mean wait and mean send seconds, and the
    all-reduce seconds (total and per micro-batch; 0 without tensor parallelism)."""
    lo, hi = wall_window(trace)
    ivs = _stage_intervals(trace)
    per = _ratios(trace, lo, hi)
    dper = decode_bubble_ratios(trace)
    stages = trace["stages"]
    return {
        "bubble_ratio": _mean(per),
        "bubble_ratio_per_stage": per,
        "decode_bubble_ratio": None if dper is None else _mean(dper),
        "decode_bubble_ratio_per_stage": dper,
        "wall_s": hi - lo,
        # a split lm_head's part on the first stage is an event of its own ("head"), not a micro-batch
        "num_micro_batches": [sum(1 for ev in st.get("events", []) if not ev.get("head")) for st in stages],
        "busy_s": [_union_length(x, lo, hi) for x in ivs],
        "mean_wait_s": [_mean([float(ev.get("wait", 0) or 0) for ev in st.get("events", [])]) for st in stages],
        "mean_send_s": [_mean([float(ev.get("send", 0) or 0) for ev in st.get("events", [])]) for st in stages],
        # tensor parallelism: seconds inside the stage's all-reduces, part of its busy time (TD-Pipe Fig. 6)
        "allreduce_s": [sum(float(ev.get("allreduce", 0) or 0) for ev in st.get("events", [])) for st in stages],
        "mean_allreduce_s": [_mean([float(ev.get("allreduce", 0) or 0) for ev in st.get("events", [])])
                             for st in stages],
    }


def stage_label(st: dict, index: int) -> str:
    """'stage k (layers a-b)' with the inclusive layer range of the half-open [a, b+1) in the trace."""
    k = st.get("stage", index)
    layers = st.get("layers")
    if layers and len(layers) == 2 and layers[1] > layers[0]:
        return f"stage {k} (layers {layers[0]}-{layers[1] - 1})"
    return f"stage {k}"


# --------------------------------------------------------------------------------------------------- picture

def plot_timeline(trace: dict, out_path: str | os.PathLike, title: str | None = None) -> str:
    """Draw the per-stage Gantt chart (TD-Pipe Fig. 2 style; stage 0 at the top, compute coloured by
    prefill / decode / mixed, the input wait as a thin light bar before it) over the KV cache usage
    fraction (Fig. 12 style step plot), and save a PNG. One broken_barh per stage per kind, so large
    traces stay fast. Returns the output path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    lo, hi = wall_window(trace)
    per = _ratios(trace, lo, hi)
    stages = trace["stages"]
    n = len(stages)
    kv = trace.get("kv") or []

    fig, (ax, axkv) = plt.subplots(2, 1, sharex=True, figsize=(12, 1.0 + 0.9 * n + 2.0),
                                   gridspec_kw={"height_ratios": [max(2.0, 0.9 * n), 2.0]})
    row_h, bar_h, wait_h = 1.0, 0.7, 0.18
    yticks, ylabels, kinds_seen = [], [], set()
    for i, st in enumerate(stages):
        y = (n - 1 - i) * row_h  # stage 0 at the top
        evs = st.get("events", [])
        waits = [(float(ev["start"]) - float(ev["wait"]), float(ev["wait"])) for ev in evs
                 if (ev.get("wait", 0) or 0) > 0]
        if waits:
            ax.broken_barh(waits, (y - wait_h / 2, wait_h), facecolors="#d9d9d9", edgecolors="none")
        by_kind: dict[str, list[tuple[float, float]]] = {}
        for ev in evs:
            s, e = float(ev["start"]), float(ev["end"])
            by_kind.setdefault(event_kind(ev), []).append((s, e - s))
        for kind, bars in by_kind.items():
            kinds_seen.add(kind)
            ax.broken_barh(bars, (y - bar_h / 2, bar_h), facecolors=KIND_COLORS[kind], edgecolors="none")
        yticks.append(y)
        ylabels.append(f"{stage_label(st, i)}\nbubble {per[i]:.1%}")
    ax.set_yticks(yticks)
    ax.set_yticklabels(ylabels)
    ax.set_ylim(-row_h / 2 - 0.1, (n - 1) * row_h + row_h / 2 + 0.1)
    handles = [Patch(color=KIND_COLORS[k], label=k) for k in ("prefill", "decode", "mixed", "other")
               if k in kinds_seen]
    handles.append(Patch(color="#d9d9d9", label="wait for input"))
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8, ncol=len(handles),
              frameon=False, borderaxespad=0.2)
    mean_b = _mean(per)
    head = title or f"tdpipe pipeline timeline (pp={trace.get('pp', n)}, policy={trace.get('policy', '?')})"
    ax.set_title(f"{head} - mean bubble ratio {mean_b:.1%}", fontsize=10, loc="left")
    ax.grid(axis="x", alpha=0.3)

    if kv:
        ts = [float(t) for t, _ in kv]
        fs = [float(f) for _, f in kv]
        axkv.step(ts, fs, where="post", color="#9467bd", linewidth=1.2)
        axkv.fill_between(ts, fs, step="post", color="#9467bd", alpha=0.25)
    else:
        axkv.text(0.5, 0.5, "no KV usage recorded", transform=axkv.transAxes, ha="center", va="center",
                  color="#7f7f7f")
    axkv.set_ylim(0, 1)
    axkv.set_ylabel("KV cache used")
    axkv.set_xlabel("time (s)")
    axkv.grid(alpha=0.3)
    pad = 0.01 * (hi - lo)
    ax.set_xlim(lo - pad, hi + pad)
    if kv:  # let the KV curve show beyond the compute window if it was sampled there
        ax.set_xlim(min(lo, min(ts)) - pad, max(hi, max(ts)) + pad)

    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return os.fspath(out_path)
