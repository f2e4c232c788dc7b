"""`tdpipe bench layouts`: one workload over several P x T layouts and policies, TD-Pipe §4.2's comparison
(TP+SB, TP+HB, PP+SB, PP+HB, TD-Pipe) run for real on this machine.

Each row is a `tdpipe bench throughput` run in a fresh process (same workload, same seed, same model,
same threads in all), one after another, never two at once (tdpipe.bench.fresh); with --repeats N every row
runs N times, the rows forward then backward in turn, and each row shows its median run. The table gives
output tokens/s, the ratio to the first row, the bubble ratio per stage and, for tensor-parallel rows, the
all-reduce time per micro-batch and its share of the stage's busy time, both from the run's trace (TD-Pipe
Fig. 6's split).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from tdpipe.bench import fresh
from tdpipe.bench import workload as wl
from tdpipe.bench.machine import describe as describe_machine

# TD-Pipe §4.2's baselines and system, by their names: (P, T, policy). SB = separate batching (prefill and
# decode never share a micro-batch), HB = hybrid batching (chunked prefill mixed into decode batches).
NAMED = {"SB": "separate", "HB": "hybrid"}
DEFAULT_ROWS = "1x1:hybrid,1x2:separate,1x2:hybrid,2x1:separate,2x1:hybrid,2x1:td-pipe,2x1:throttle"


@dataclass(frozen=True)
class Row:
    pp: int
    tp: int
    policy: str

    @property
    def spec(self) -> str:
        """As --rows writes it: what tells rows apart (two names can be one, e.g. PP+HB at P = 2 and 3)."""
        return f"{self.pp}x{self.tp}:{self.policy}"

    @property
    def name(self) -> str:
        if self.pp == 1 and self.tp == 1:
            return f"1 process ({self.policy})"
        kind = "TP" if self.pp == 1 else "PP" if self.tp == 1 else f"PP{self.pp}xTP"
        short = {v: k for k, v in NAMED.items()}.get(self.policy)
        if short:
            return f"{kind}+{short}"
        return {"td-pipe": "TD-Pipe", "throttle": "gLLM throttle"}.get(self.policy, self.policy) + (
            "" if kind == "PP" else f" ({kind})")


def parse_rows(spec: str) -> list[Row]:
    """'PxT:policy,...', e.g. '1x2:separate,2x1:td-pipe'."""
    from tdpipe.core.scheduler.registry import policy_names

    rows = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        try:
            shape, policy = item.split(":")
            p, t = (int(x) for x in shape.lower().split("x"))
        except ValueError:
            raise ValueError(f"--rows item {item!r}: expected PxT:policy, e.g. 2x1:td-pipe") from None
        if p < 1 or t < 1:
            raise ValueError(f"--rows item {item!r}: P and T must be >= 1")
        if policy not in policy_names():
            raise ValueError(f"--rows item {item!r}: unknown policy {policy!r} (one of {', '.join(policy_names())})")
        rows.append(Row(p, t, policy))
    if not rows:
        raise ValueError("--rows is empty")
    twice = sorted({r.spec for r in rows if rows.count(r) > 1})
    if twice:
        raise ValueError(f"--rows names {', '.join(twice)} twice; run rows again with --repeats")
    return rows


def add_parser(bsub: Any) -> argparse.ArgumentParser:
    p = bsub.add_parser(
        "layouts", help="one workload over P x T layouts and policies (TD-Pipe §4.2: TP+SB, TP+HB, PP+SB, "
                        "PP+HB, TD-Pipe)",
        description="Run `tdpipe bench throughput` once per row, each in a fresh process, on the same workload "
                    "and threads, and tabulate tokens/s, ratios, bubbles and the tensor-parallel all-reduce "
                    "time from each run's trace. " + __doc__.split("\n\n")[1].replace("\n", " "))
    wl.add_workload_args(p)
    p.add_argument("--model", default=None,
                   help="model folder, GGUF, or random:NAME (random weights of a published config; default: the "
                        "bundled SmolLM2)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (default) or float32")
    p.add_argument("--rows", default=DEFAULT_ROWS, metavar="PxT:POLICY,...",
                   help="the layouts and policies, in order; the first is the ratios' reference "
                        "(default: %(default)s)")
    p.add_argument("--kv-cache-memory", default=None, help="KV cache budget of every row (as bench throughput)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="as bench throughput, every row")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="as bench throughput, every row")
    p.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="run every row N times, the rows in alternating order (forward, then backward), and "
                        "show each row's median run (default: %(default)s)")
    p.add_argument("--json", default=None, metavar="FILE", help="write every row's full result and the table")
    p.set_defaults(fn=run)
    return p


def _row_cmd(a: argparse.Namespace, row: Row, out: str) -> list[str]:
    cmd = [*fresh.CLI, "bench", "throughput", "--pp", str(row.pp),
           "--tp", str(row.tp), "--scheduler", row.policy, "--dtype", a.dtype, "--json", out,
           "--num-prompts", str(a.num_prompts), "--workload-seed", str(a.workload_seed)]
    for flag, v in (("--model", a.model), ("--input-len", a.input_len), ("--output-len", a.output_len),
                    ("--dataset", a.dataset), ("--history", a.history), ("--kv-cache-memory", a.kv_cache_memory),
                    ("--max-num-seqs", a.max_num_seqs), ("--max-num-batched-tokens", a.max_num_batched_tokens)):
        if v is not None:
            cmd += [flag, str(v)]
    if a.workload != "sharegpt":
        cmd += ["--workload", a.workload]
    if a.history:
        cmd += ["--history-split", a.history_split]
    return cmd


def _tok_s(r: dict[str, Any]) -> float:
    return r["output_tokens_per_s"]


def run(a: argparse.Namespace) -> int:
    rows = parse_rows(a.rows)
    by_spec = {row.spec: row for row in rows}
    runs = fresh.run_sides(list(by_spec), a.repeats, lambda side, r, out, done: _row_cmd(a, by_spec[side], out),
                           describe=lambda run: f"{_tok_s(run.result):.1f} output tok/s")
    fresh.check_same_work(runs, lambda r: (r["workload"], r["num_requests"], r["total_input_tokens"]))
    results = []
    for row in rows:  # each row's median run, with every run's figure beside it
        med = fresh.median_run(runs, row.spec, _tok_s).result
        results.append({"row": row.name, "pp": row.pp, "tp": row.tp, "policy": row.policy} | med
                       | {"output_tokens_per_s_runs": fresh.values(runs, row.spec, _tok_s)})
    table = summarize(results)
    print(format_table(table, results[0]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"table": table, "comparison": fresh.method(list(by_spec), a.repeats, runs), "runs": results},
                      f, indent=2, default=str)
    return 0


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per row: throughput, ratio to the first row, bubbles, all-reduce (trace) per stage."""
    base = results[0]["output_tokens_per_s"]
    out = []
    for r in results:
        busy = r.get("busy_s_per_stage") or []
        ar = r.get("allreduce_s_per_stage") or [0.0] * len(busy)
        out.append({
            "row": r["row"], "pp": r["pp"], "tp": r["tp"], "policy": r["policy"],
            "output_tokens_per_s": r["output_tokens_per_s"], "ratio": r["output_tokens_per_s"] / base,
            "elapsed_s": r["elapsed_s"], "bubble_ratio_per_stage": r["bubble_ratio_per_stage"],
            "allreduce_ms_per_step": r.get("allreduce_ms_per_step") or [0.0] * len(busy),
            "allreduce_share_of_busy": [x / b if b else 0.0 for x, b in zip(ar, busy)],
            "preemptions": r.get("preemptions"),
            "output_tokens_per_s_runs": r.get("output_tokens_per_s_runs") or [r["output_tokens_per_s"]],
        })
    return out


def format_table(table: list[dict[str, Any]], first: dict[str, Any]) -> str:
    w, m = first["workload"], first["machine"]
    runs = len(table[0]["output_tokens_per_s_runs"]) if table and "output_tokens_per_s_runs" in table[0] else 1
    head = (f"workload {w['name']} (seed {w['seed']}): {first['num_requests']} requests, input mean "
            f"{w['input_mean']:.0f}, output mean {w['output_mean']:.0f}; model {first['model']}; "
            f"{describe_machine(m)}, {first['threads']} threads in every row, {first['dtype']}; each run in its "
            "own process" + (f", {runs} runs per row in alternating order, medians" if runs > 1 else ""))
    lines = [head, "", f"{'row':<22} {'layout':<10} {'out tok/s':>10} {'ratio':>6}  {'bubble per stage':<18} "
                       "all-reduce per step (share of busy)"]
    for t in table:
        bub = ",".join(f"{b:.2f}" for b in t["bubble_ratio_per_stage"])
        ar = ("-" if t["tp"] == 1 else ", ".join(f"{ms:.2f} ms ({100 * s:.0f}%)" for ms, s in
                                                 zip(t["allreduce_ms_per_step"], t["allreduce_share_of_busy"])))
        each = t.get("output_tokens_per_s_runs") or []
        lines.append(f"{t['row']:<22} {t['pp']}x{t['tp']:<8} {t['output_tokens_per_s']:>10.1f} "
                     f"{t['ratio']:>5.2f}x  {bub:<18} {ar}"
                     + (f"  (runs: {', '.join(f'{x:.1f}' for x in each)})" if len(each) > 1 else ""))
    return "\n".join(lines)


__all__ = ["DEFAULT_ROWS", "Row", "add_parser", "format_table", "parse_rows", "run", "summarize"]
