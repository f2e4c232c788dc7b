"""`tdpipe plot latency`: gLLM Fig. 10's latency panels from a `tdpipe bench serve --json` file; the
picture itself is viz/latency.py's."""
from __future__ import annotations

import argparse
from typing import Any

from tdpipe.entrypoints.preflight import check_writable


def cmd_plot_latency(a: argparse.Namespace) -> int:
    from tdpipe.viz.latency import load_runs, plot_latency

    check_writable(a.output, "--output")  # before the JSON is read: a bad --output fails at once
    print(f"wrote {plot_latency(load_runs(a.json), a.output, title=a.title)}")
    return 0


def add_parser(plsub: Any) -> argparse.ArgumentParser:
    p = plsub.add_parser(
        "latency", help="mean TTFT and TPOT against request rate per policy (PNG), from bench serve --json",
        description="Draw gLLM Fig. 10's latency panels from a `tdpipe bench serve --json` file: mean TTFT "
                    "and mean TPOT against request rate, one line per run label (e.g. per scheduling "
                    "policy).")
    p.add_argument("--json", required=True, metavar="FILE", help="results of `tdpipe bench serve --json`")
    p.add_argument("--output", "-o", default="latency.png", help="PNG to write (default latency.png)")
    p.add_argument("--title", default=None, help="title of the picture")
    p.set_defaults(fn=cmd_plot_latency)
    return p


__all__ = ["add_parser", "cmd_plot_latency"]
