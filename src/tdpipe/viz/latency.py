"""Latency against request rate, one line per run label (policy): gLLM Fig. 10's TTFT and TPOT panels.

Reads what `tdpipe bench serve --json` writes (format ``tdpipe-bench-serve/1``)::

    {"format": "tdpipe-bench-serve/1",
     "runs": [{"label": "td-pipe pp=2", ...,
               "results": [{"request_rate": "1", "ttft_ms": {"mean": 80.1, "p50": ..., ...},
                            "tpot_ms": {"mean": 21.3, ...}, ...}, ...]}, ...]}

``request_rate`` is a number as a string, or "inf" (every request at once). The x axis is categorical (the
rates of all runs, sorted, "inf" last), as the paper's figure spaces 1, 2, 4 evenly; a rate a run did not
measure, or where no request succeeded, is a gap in its line.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any

FORMAT = "tdpipe-bench-serve/1"
PANELS = (("ttft_ms", "mean TTFT (ms)"), ("tpot_ms", "mean TPOT (ms)"))


def _rate(x: Any, where: str) -> float:
    try:
        r = math.inf if x == "inf" else float(x)
    except (TypeError, ValueError):
        raise ValueError(f"{where}.request_rate must be a number or 'inf', got {x!r}") from None
    if not r > 0:
        raise ValueError(f"{where}.request_rate must be > 0, got {x!r}")
    return r


def validate_runs(doc: Any) -> list[dict[str, Any]]:
    """Check a bench-serve document; raise ValueError naming the first problem. Returns its runs."""
    if not isinstance(doc, dict):
        raise ValueError(f"expected a JSON object, got {type(doc).__name__}")
    if doc.get("format") != FORMAT:
        raise ValueError(f"unsupported format {doc.get('format')!r} (expected {FORMAT!r}, what `tdpipe bench "
                         "serve --json` writes)")
    runs = doc.get("runs")
    if not isinstance(runs, list):
        raise ValueError("field 'runs' must be a list")
    for i, run in enumerate(runs):
        where = f"runs[{i}]"
        if not isinstance(run, dict) or not isinstance(run.get("label"), str):
            raise ValueError(f"{where} must be an object with a string 'label'")
        res = run.get("results")
        if not isinstance(res, list):
            raise ValueError(f"{where}.results must be a list")
        for j, m in enumerate(res):
            w = f"{where}.results[{j}]"
            if not isinstance(m, dict):
                raise ValueError(f"{w} must be an object")
            _rate(m.get("request_rate"), w)
            for key, _ in PANELS:
                if not isinstance(m.get(key), dict):
                    raise ValueError(f"{w}.{key} must be an object with a 'mean'")
                v = m[key].get("mean")
                if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                    raise ValueError(f"{w}.{key}.mean must be a number or null, got {v!r}")
    return runs


def load_runs(path: str | os.PathLike) -> list[dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read ({e})") from None
    try:
        return validate_runs(doc)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def series(runs: list[dict[str, Any]], key: str) -> tuple[list[float], dict[str, list[float | None]]]:
    """The sorted rates over all runs and, per label, the mean of `key` at each (None where missing)."""
    rates = sorted({_rate(m["request_rate"], "result") for r in runs for m in r["results"]})
    out: dict[str, list[float | None]] = {}
    for run in runs:
        by_rate = {_rate(m["request_rate"], "result"): (m.get(key) or {}).get("mean") for m in run["results"]}
        out[run["label"]] = [by_rate.get(x) for x in rates]
    return rates, out


def plot_latency(runs: list[dict[str, Any]], out_path: str | os.PathLike, title: str | None = None) -> str:
    """Two panels, mean TTFT and mean TPOT against request rate, one line per label; saves a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not any(r["results"] for r in runs):
        raise ValueError("no results to plot")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (key, ylabel) in zip(axes, PANELS):
        rates, lines = series(runs, key)
        xs = list(range(len(rates)))
        for label, ys in lines.items():
            ax.plot(xs, [math.nan if y is None else y for y in ys], marker="o", label=label)
        ax.set_xticks(xs)
        ax.set_xticklabels(["inf" if math.isinf(r) else f"{r:g}" for r in rates])
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title or "latency against request rate (tdpipe bench serve)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return os.fspath(out_path)


__all__ = ["FORMAT", "load_runs", "plot_latency", "series", "validate_runs"]
