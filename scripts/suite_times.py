"""Where the test suite's time goes: a table per test file from `pytest --suite-times FILE`'s JSON lines.

    .venv/bin/python -m pytest --suite-times /tmp/times.jsonl
    .venv/bin/python scripts/suite_times.py /tmp/times.jsonl [--top 30]

Columns: wall seconds inside the file's tests (setup and teardown included), the pytest process's CPU
seconds, and the CPU seconds of the processes its tests started and reaped (CLI runs, engine cores, stages;
a child is counted in the test that reaped it). The last lines split the suite into tests that started
processes and tests that did not, and show each pytest-xdist worker's busy seconds against the whole run's
span (a worker idle at the end waited for the other's last tests), and how long the workers' cores sat idle
while their tests ran (near zero: the suite is CPU-bound, and only less work makes it faster).
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("file", help="the JSON lines `pytest --suite-times FILE` wrote")
    p.add_argument("--top", type=int, default=30, help="files to list, slowest first (default: %(default)s)")
    a = p.parse_args()
    rows = [json.loads(line) for line in open(a.file) if line.strip()]
    by: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    for r in rows:
        b = by[r["id"].split("::")[0]]
        b[0] += r["wall"]
        b[1] += r["cpu"]
        b[2] += r["children_cpu"]
        b[3] += 1
    print(f"{'wall s':>8} {'cpu s':>8} {'children':>9} {'tests':>5}  file")
    for f, (wall, cpu, child, n) in sorted(by.items(), key=lambda kv: -kv[1][0])[:a.top]:
        print(f"{wall:8.1f} {cpu:8.1f} {child:9.1f} {n:5d}  {f}")
    procs = [r for r in rows if r["children_cpu"] > 0.5]
    rest = [r for r in rows if r["children_cpu"] <= 0.5]
    for name, group in (("starting processes", procs), ("in the pytest process", rest)):
        print(f"{len(group)} tests {name}: {sum(r['wall'] for r in group):.0f} s wall, "
              f"{sum(r['cpu'] for r in group):.0f} s CPU, children {sum(r['children_cpu'] for r in group):.0f} s CPU")
    print(f"all {len(rows)} tests: {sum(r['wall'] for r in rows):.0f} s wall")
    if all("start" in r for r in rows):  # lines written before the workers' fields were added lack them
        span = max(r["start"] + r["wall"] for r in rows) - min(r["start"] for r in rows)
        workers: dict[str, float] = defaultdict(float)
        for r in rows:
            workers[r["worker"]] += r["wall"]
        print(f"span {span:.0f} s; busy " + ", ".join(f"{w} {t:.0f} s" for w, t in sorted(workers.items())))
    if all("idle" in r for r in rows):
        idle: dict[str, float] = defaultdict(float)
        for r in rows:
            idle[r["worker"]] += r["idle"]
        print("cores idle while tests ran: " + ", ".join(f"{w} {t:.0f} s" for w, t in sorted(idle.items())))


if __name__ == "__main__":
    main()
