"""Where a pp = 2 run's stages sit idle, from its trace (`tdpipe bench throughput ... --trace FILE`): every
gap between two events of a stage, named by what the stage did before and what it waited for. With half the
lm_head on stage 0 (`--lm-head-split 0.5`), stage 0's cycle is: its layers for micro-batch B, then the head
part of micro-batch A (which waits for A's rows from stage 1), then its layers for A's successor (which waits
for the engine: A's result, sampling, scheduling, the next step's message and input preparation).

  python3 bench_results/pp_efficiency/idle_breakdown.py TRACE.json[.gz] [--json OUT]
"""
import argparse
import collections
import gzip
import json
import statistics


def kind(ev: dict) -> str:
    if ev.get("head"):
        return "head"
    if ev["prefill_tokens"] and ev["decode_seqs"]:
        return "mixed"
    return "prefill" if ev["prefill_tokens"] else "decode"


def breakdown(trace: dict) -> dict:
    stages = trace["stages"]
    lo = min(e["start"] for s in stages for e in s["events"])
    hi = max(e["end"] for s in stages for e in s["events"])
    out = {"wall_s": hi - lo, "stages": []}
    for k, st in enumerate(stages):
        evs = sorted(st["events"], key=lambda e: e["start"])
        gaps: dict = collections.defaultdict(list)
        for a, b in zip(evs, evs[1:]):
            if b["start"] > a["end"]:
                before = "head" if a.get("head") else "layers"
                gaps[f"{before} -> {kind(b)}"].append(b["start"] - a["end"])
        idle = sum(sum(v) for v in gaps.values())
        layers = [e for e in evs if not e.get("head")]
        dec = [e["end"] - e["start"] for e in layers if kind(e) == "decode"]
        q = statistics.quantiles(dec, n=10) if len(dec) > 1 else None
        out["stages"].append({
            "stage": k, "idle_s": idle, "idle_ratio": idle / out["wall_s"],
            "busy_s": sum(e["end"] - e["start"] for e in evs),
            "gaps": {g: {"count": len(v), "total_s": sum(v), "mean_ms": 1000 * sum(v) / len(v)}
                     for g, v in sorted(gaps.items())},
            "decode_event_ms": {"mean": 1000 * statistics.mean(dec), "p10": 1000 * q[0], "p90": 1000 * q[8]}
            if q else None,
            "decode_rows_mean": statistics.mean(e["decode_seqs"] for e in layers if kind(e) == "decode")
            if dec else None,
        })
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--json")
    a = ap.parse_args()
    opener = gzip.open if a.trace.endswith(".gz") else open
    with opener(a.trace, "rt") as f:
        res = breakdown(json.load(f))
    print(f"wall {res['wall_s']:.1f} s")
    for s in res["stages"]:
        print(f"stage {s['stage']}: busy {s['busy_s']:.1f} s, idle {s['idle_s']:.1f} s "
              f"({s['idle_ratio']:.3f})")
        for g, v in s["gaps"].items():
            print(f"  waiting {g:<20} {v['count']:>5} x {v['mean_ms']:6.1f} ms = {v['total_s']:6.1f} s")
        if s["decode_event_ms"]:
            d = s["decode_event_ms"]
            print(f"  decode events {d['mean']:.1f} ms mean (p10 {d['p10']:.1f}, p90 {d['p90']:.1f}), "
                  f"{s['decode_rows_mean']:.1f} rows")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
