"""Goodput of every run in a `tdpipe bench serve --json` file under several TTFT / TPOT SLO pairs, recomputed
from each request's TTFT and TPOT (the lecture's §4 goodput: requests/s that meet every SLO). Prints a
markdown table and draws goodput against request rate, one line per run (mode), one panel per SLO pair.

    python scripts/pd/goodput.py bench_results/disaggregation/serve_modes.json \
        --slo 3000:250 --slo 1000:60 --plot bench_results/disaggregation/goodput.png
"""
from __future__ import annotations

import argparse
import json
import math


def parse_slo(text: str) -> tuple[float, float]:
    ttft, tpot = text.split(":")
    return float(ttft), float(tpot)


def goodput(rate: dict, slo: tuple[float, float]) -> tuple[float, float]:
    """(good requests per second of the rate's wall time, the fraction of requests that met both)."""
    per = rate["per_request"]
    good = sum(1 for ttft, tpot in zip(per["ttft_ms"], per["tpot_ms"])
               if ttft is not None and ttft <= slo[0] and (tpot is None or tpot <= slo[1]))
    return good / rate["duration_s"], good / rate["num_requests"]


def rate_value(label: str) -> float:
    return math.inf if label == "inf" else float(label)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json")
    p.add_argument("--slo", action="append", type=parse_slo, required=True, metavar="TTFT_MS:TPOT_MS")
    p.add_argument("--plot", default=None, metavar="PNG")
    a = p.parse_args()
    runs = json.load(open(a.json))["runs"]
    print("| mode | rate (req/s) | TTFT mean / p99 (ms) | TPOT mean / p99 (ms) | output tok/s | "
          + " | ".join(f"goodput req/s (SLO met), TTFT <= {t:g} ms, TPOT <= {o:g} ms" for t, o in a.slo) + " |")
    print("| --- " * (5 + len(a.slo)) + "|")
    for run in runs:
        for r in run["results"]:
            cells = [run["label"], r["request_rate"],
                     f"{r['ttft_ms']['mean']:.0f} / {r['ttft_ms']['p99']:.0f}",
                     f"{r['tpot_ms']['mean']:.0f} / {r['tpot_ms']['p99']:.0f}", f"{r['output_throughput']:.1f}"]
            cells += [f"{g:.2f} ({100 * f:.0f} %)" for g, f in (goodput(r, s) for s in a.slo)]
            print("| " + " | ".join(cells) + " |")
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(a.slo), figsize=(5.5 * len(a.slo), 4), squeeze=False)
        for ax, slo in zip(axes[0], a.slo):
            for run in runs:
                xs = [rate_value(r["request_rate"]) for r in run["results"]]
                ax.plot(xs, [goodput(r, slo)[0] for r in run["results"]], marker="o", label=run["label"])
            ax.set_title(f"TTFT <= {slo[0]:g} ms, TPOT <= {slo[1]:g} ms")
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel("goodput (req/s)")
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)


if __name__ == "__main__":
    main()
