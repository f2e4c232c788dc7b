"""`tdpipe bench prefix`: what sharing a prompt's KV buys, caching on against off in one sitting.

One workload runs through several engine configurations ("rows"), each row in a fresh process of its own
(tdpipe.bench.fresh: an engine run after another in one process is not the engine run alone), one after
another; with --repeats N every row runs N times, the rows forward then backward in turn, and each row
shows its median run. A row's process builds the workload (the same seed, so the same prompts), its LLM,
warms it up untimed, then submits the whole workload at once, as `bench throughput` does. Output lengths
are forced (ignore_eos, max_tokens), so every row computes exactly the same tokens and the ratios are
ratios of elapsed time.

Workloads and rows:
  - grpo: a GRPO-like rollout, prompts of ~512 tokens x n = 8 samples of 256 tokens at temperature 1;
      no-sharing   each prompt as n independent n=1 requests (seeds seed * n + i), caching off: parallel
                   sampling without fork, as vLLM v1 serves n when prefix caching is off (the baseline);
      fork         n = 8 requests, caching off: the prompt is prefilled once and forked (copy-on-write);
      fork-cache   n = 8 requests, caching on;
      no-sharing-cache (only with --rows) independent requests with caching on: sharing by the cache alone.
  - shared-prefix: requests sharing a 1,024-token system prompt with short distinct questions, greedy;
      cache-off (the baseline), cache-on.

Throughput counts each workload request's prompt once and every sample's output tokens, in every row
(the split row submits n requests per workload request, but does the same logical work). The prefix-cache
figures are deltas of the block manager's counters over the timed run (in tokens): hit rate = hits / queries,
cached tokens = hits (prompt tokens whose KV came from the cache instead of being computed).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from tdpipe.bench import fresh
from tdpipe.bench import workload as wl
from tdpipe.bench.machine import describe as describe_machine
from tdpipe.bench.machine import machine_info
from tdpipe.bench.throughput import preflight
from tdpipe.core.scheduler.registry import get_policy
from tdpipe.entrypoints.args import add_engine_args, engine_kwargs

WORKLOADS = ("grpo", "shared-prefix")
# per workload: flag dest -> default (None in the parser, so a flag meant for the other workload is refused)
DEFAULTS: dict[str, dict[str, Any]] = {
    "grpo": {"num_prompts": 64, "input_len": 512, "n": 8, "output_len": 256},
    "shared-prefix": {"num_prompts": 1000, "prefix_len": 1024, "question_len": (16, 48), "output_len": 32},
}
FLAG = {"num_prompts": "--num-prompts", "input_len": "--input-len", "n": "--n", "output_len": "--output-len",
        "prefix_len": "--prefix-len", "question_len": "--question-len"}
WARMUP_PROMPT_TOKENS = 8
WARMUP_OUTPUT_TOKENS = 2
WARMUP_SEED = 2**32 - 1  # the warm-up prompts are their own draw: they share no block with the workload


@dataclass(frozen=True)
class Row:
    """One engine configuration of a comparison."""

    name: str
    label: str
    split: bool  # submit n independent n=1 requests instead of one request with n samples
    caching: bool  # enable_prefix_caching
    default: bool = True  # run without --rows


ROWS: dict[str, tuple[Row, ...]] = {
    "grpo": (Row("no-sharing", "no sharing (n independent requests), caching off", True, False),
             Row("fork", "fork (n=N), caching off", False, False),
             Row("fork-cache", "fork (n=N) + caching on", False, True),
             Row("no-sharing-cache", "n independent requests, caching on", True, True, default=False)),
    "shared-prefix": (Row("cache-off", "caching off", False, False),
                      Row("cache-on", "caching on", False, True)),
}


# -- CLI -----------------------------------------------------------------------------------------------
def _question_len(v: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in v.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--question-len {v!r}: expected MIN,MAX, e.g. 16,48") from None
    return lo, hi


def _rows_help() -> str:
    """Every workload's rows, for --help."""
    def one(r: Row) -> str:
        return f"{r.name} [{r.label}" + ("]" if r.default else "; only with --rows]")
    return "; ".join(f"{w}: " + ", ".join(one(r) for r in rows) for w, rows in ROWS.items())


def add_parser(bsub: Any) -> argparse.ArgumentParser:
    p = bsub.add_parser(
        "prefix", help="parallel sampling and prefix caching: the same workload with caching off and on",
        description="Run one workload (grpo: a GRPO-like rollout, n samples per prompt; shared-prefix: "
                    "requests sharing a long system prompt) through several engine configurations in the "
                    "same run and report each one's throughput, prefix-cache hit rate and ratio to the "
                    "baseline. Output lengths are forced (ignore_eos), so every row does the same work. "
                    "Rows: " + _rows_help() + ". The first row of each workload is the baseline.")
    p.add_argument("--workload", required=True, choices=WORKLOADS,
                   help="grpo: prompts of ~--input-len tokens (+-12.5%%) x --n samples of --output-len "
                        "tokens, temperature 1, seeded; shared-prefix: --num-prompts requests = one "
                        "--prefix-len system prompt + a distinct question of --question-len tokens, greedy")
    p.add_argument("--rows", default=None, metavar="NAME,...",
                   help="run only these rows, in this order (default: every default row of the workload)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="workload requests (default: 64 for grpo, 1000 for shared-prefix)")
    p.add_argument("--output-len", type=int, default=None,
                   help="output tokens of every sample (default: 256 for grpo, 32 for shared-prefix)")
    p.add_argument("--input-len", type=int, default=None, help="grpo: mean prompt length (default: 512)")
    p.add_argument("--n", type=int, default=None, help="grpo: samples per prompt (default: 8)")
    p.add_argument("--prefix-len", type=int, default=None,
                   help="shared-prefix: tokens of the shared system prompt (default: 1024)")
    p.add_argument("--question-len", type=_question_len, default=None, metavar="MIN,MAX",
                   help="shared-prefix: question lengths, uniform in MIN..MAX tokens (default: 16,48)")
    p.add_argument("--workload-seed", type=int, default=0, metavar="N", help="seed of the synthetic workload")
    p.add_argument("--json", default=None, metavar="FILE", help="write every row's results as JSON")
    p.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="run every row N times, the rows in alternating order (forward, then backward), each run "
                        "in a fresh process, and show each row's median run (default: %(default)s)")
    p.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)  # a row's own process
    add_engine_args(p)
    for act in p._actions:
        if act.dest == "enable_prefix_caching":
            act.help = "not taken here: each row sets caching itself (pick rows with --rows)"
    # each row sets caching itself: None tells an explicit --(no-)enable-prefix-caching apart, to refuse it
    p.set_defaults(fn=lambda a: run(a, p), enable_prefix_caching=None)
    return p


def workload_params(a: argparse.Namespace) -> dict[str, Any]:
    """The workload's parameters from the flags (defaults filled in); ValueError naming a bad flag."""
    own = DEFAULTS[a.workload]
    for dest, flag in FLAG.items():
        if dest not in own and getattr(a, dest) is not None:
            other = next(w for w in WORKLOADS if dest in DEFAULTS[w])
            raise ValueError(f"{flag} applies to --workload {other}, not {a.workload}")
    p = {dest: own[dest] if getattr(a, dest) is None else getattr(a, dest) for dest in own}
    for dest in ("num_prompts", "output_len", "input_len", "n", "prefix_len"):
        if dest in p and p[dest] < 1:
            raise ValueError(f"{FLAG[dest]} must be >= 1, got {p[dest]}")
    if "question_len" in p:
        lo, hi = p["question_len"]
        if lo < 1 or hi < lo:
            raise ValueError(f"--question-len must be MIN,MAX with 1 <= MIN <= MAX, got {lo},{hi}")
    return {"name": a.workload, "seed": a.workload_seed} | p


def select_rows(workload: str, spec: str | None) -> list[Row]:
    """The rows --rows names (in its order), or the workload's default rows; ValueError naming --rows."""
    rows = ROWS[workload]
    if spec is None:
        return [r for r in rows if r.default]
    by_name = {r.name: r for r in rows}
    names = [x.strip() for x in spec.split(",") if x.strip()]
    unknown = [x for x in names if x not in by_name]
    if unknown or not names:
        raise ValueError(f"--rows {spec!r}: {'unknown ' + ', '.join(unknown) if unknown else 'no row'}; "
                         f"--workload {workload} has {', '.join(by_name)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--rows {spec!r}: a row is named twice")
    return [by_name[x] for x in names]


def check_args(a: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    """Every flag checked before a model loads."""
    if a.enable_prefix_caching is not None:
        raise ValueError("--enable-prefix-caching / --no-enable-prefix-caching: each row sets caching "
                         "itself; pick rows with --rows")
    return workload_params(a), select_rows(a.workload, a.rows)


def build_workload(params: dict[str, Any], vocab_size: int, max_model_len: int) -> list[wl.BenchRequest]:
    """The workload the flags describe, checked against the engine's limits (every row uses the same)."""
    if params["name"] == "grpo":
        reqs = wl.grpo(params["num_prompts"], vocab_size, params["seed"], input_len=params["input_len"],
                       n=params["n"], output_len=params["output_len"])
    else:
        reqs = wl.shared_prefix(params["num_prompts"], vocab_size, params["seed"],
                                prefix_len=params["prefix_len"], question_len=tuple(params["question_len"]),
                                output_len=params["output_len"])
    longest = max(r.input_len + r.output_len for r in reqs)
    if longest > max_model_len:
        raise ValueError(f"the longest request needs {longest} tokens (prompt + output) but max_model_len is "
                         f"{max_model_len}; lower --output-len / --input-len / --prefix-len or raise "
                         "--max-model-len")
    return reqs


def command_line(a: argparse.Namespace, p: argparse.ArgumentParser) -> str:
    """The command that reproduces this run: every option that differs from its default, as given."""
    return shlex.join(["tdpipe", "bench", "prefix", *fresh.replay_flags(p, a)])


# -- one row -------------------------------------------------------------------------------------------
def submissions(reqs: list[wl.BenchRequest],
                split: bool) -> tuple[list[dict[str, Any]], list[Any], list[int]]:
    """The prompts and sampling params a row submits, and for each submission its workload request."""
    from tdpipe.sampling.params import SamplingParams

    subs = wl.split_samples(reqs) if split else reqs
    owner = [k for k, r in enumerate(reqs) for _ in range(r.n)] if split else list(range(len(reqs)))
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in subs]
    params = [SamplingParams(n=r.n, temperature=r.temperature, seed=r.seed, ignore_eos=True,
                             max_tokens=r.output_len) for r in subs]
    return prompts, params, owner


def warm_up(llm: Any, reqs: list[wl.BenchRequest], split: bool, vocab_size: int) -> None:
    """Two short requests shaped like the row's (n, temperature) through the engine, untimed: kernel JIT,
    allocator and worker start-up stay out of the timing. Their prompts are a separate draw, so they leave
    nothing in the prefix cache that the workload could hit."""
    from tdpipe.sampling.params import SamplingParams

    rng = np.random.default_rng(WARMUP_SEED)
    r = reqs[0]
    n = 1 if split else min(r.n, 2)
    prompts = [{"prompt_token_ids": wl._random_ids(rng, WARMUP_PROMPT_TOKENS, vocab_size)} for _ in range(2)]
    llm.generate(prompts, SamplingParams(n=n, temperature=r.temperature, seed=0, ignore_eos=True,
                                         max_tokens=WARMUP_OUTPUT_TOKENS), use_tqdm=False)


def _counters(engine: Any) -> dict[str, Any]:
    st = engine.stats
    pc = engine.block_manager.prefix_cache_stats()
    return {"policy": get_policy(engine.scheduler.config.policy).read_stats(engine.scheduler),
            "prefill_steps": st.prefill_steps, "decode_steps": st.decode_steps, "mixed_steps": st.mixed_steps,
            "prompt_tokens": st.prompt_tokens, "queries": pc["queries"], "hits": pc["hits"]}


def timed_run(llm: Any, reqs: list[wl.BenchRequest], row: Row) -> dict[str, Any]:
    """Warm up, then the whole workload at once; the row's metrics (counters as deltas over the timed run)."""
    engine = llm.engine
    warm_up(llm, reqs, row.split, engine.model_config.vocab_size)
    prompts, params, owner = submissions(reqs, row.split)
    c0 = _counters(engine)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=sys.stderr.isatty())
    elapsed = time.perf_counter() - t0
    c1 = _counters(engine)

    errors = [o.error for o in outs if o.error]
    if errors:
        raise ValueError(f"row {row.name}: {len(errors)} of {len(outs)} requests failed; first: {errors[0]}")
    samples = [0] * len(reqs)
    tokens = [0] * len(reqs)
    wrong_len = 0
    for k, o in zip(owner, outs):
        samples[k] += len(o.outputs)
        for c in o.outputs:
            tokens[k] += len(c.token_ids)
            wrong_len += len(c.token_ids) != reqs[k].output_len
    short = [k for k, r in enumerate(reqs) if samples[k] != r.n]
    in_tok = sum(r.input_len for r in reqs)
    out_tok = sum(tokens)
    expected_out = sum(r.n * r.output_len for r in reqs)
    queries, hits = c1["queries"] - c0["queries"], c1["hits"] - c0["hits"]
    pc_end = engine.block_manager.prefix_cache_stats()
    policy = {k: v - c0["policy"][k] for k, v in c1["policy"].items()}
    return {
        "row": row.name, "label": row.label, "enable_prefix_caching": row.caching,
        "submission": "n independent n=1 requests" if row.split else "one request with n samples",
        "submitted_requests": len(prompts),
        "elapsed_s": elapsed,
        "requests_per_s": len(reqs) / elapsed,
        "samples_per_s": sum(samples) / elapsed,
        "output_tokens_per_s": out_tok / elapsed,
        "total_tokens_per_s": (in_tok + out_tok) / elapsed,
        "num_requests": len(reqs),
        "num_samples": sum(samples),
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "expected_output_tokens": expected_out,
        # every sample of every request came back with its forced length: the rows did the same work
        "complete": not short and not wrong_len and out_tok == expected_out,
        "requests_with_missing_samples": len(short),
        "samples_with_wrong_length": wrong_len,
        "prefix_cache": {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries else 0.0,
                         "cached_tokens": hits, "cached_blocks_at_end": pc_end["cached_blocks"],
                         "evictable_blocks_at_end": pc_end["evictable_blocks"]},
        # prompt tokens the engine computed (prefill and recomputation after preemption; not cache hits)
        "prefill_tokens_computed": c1["prompt_tokens"] - c0["prompt_tokens"],
        "preemptions": policy.get("preemptions"),
        "policy_stats": policy,
        "prefill_steps": c1["prefill_steps"] - c0["prefill_steps"],
        "decode_steps": c1["decode_steps"] - c0["decode_steps"],
        "mixed_steps": c1["mixed_steps"] - c0["mixed_steps"],
        "kv_blocks": engine.block_manager.num_blocks,
        "block_size": engine.block_manager.block_size,
        "pp": engine.pp,
        "policy": engine.scheduler.config.policy,
    }


def _row_kwargs(a: argparse.Namespace, row: Row) -> dict[str, Any]:
    kw = engine_kwargs(a) | {"enable_prefix_caching": row.caching}
    if kw.get("trace"):  # one timeline per row, next to the file asked for
        stem, dot, ext = kw["trace"].rpartition(".")
        kw["trace"] = f"{stem}.{row.name}.{ext}" if dot and "/" not in ext else f"{kw['trace']}.{row.name}"
    return kw


# -- the command -----------------------------------------------------------------------------------------
def run(a: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    params, rows = check_args(a)
    preflight(a)
    if a.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {a.repeats}")
    if a.in_process:
        res = run_here(a, parser, params, rows)
    elif parser is None:
        raise ValueError("tdpipe bench prefix runs its rows from the command line (`tdpipe bench prefix`)")
    else:
        res = run_fresh(a, parser, params, rows)
    print(format_table(res))
    if a.json:
        _write_json(a.json, res)
    return 0


def _baseline(workload: str, rows: list[Row]) -> str:
    """The workload's first row; if --rows left it out, the first row run."""
    base = ROWS[workload][0].name
    return base if base in [r.name for r in rows] else rows[0].name


def _tok_s(r: dict[str, Any]) -> float:
    return r["rows"][0]["output_tokens_per_s"]


def run_fresh(a: argparse.Namespace, parser: argparse.ArgumentParser, params: dict[str, Any],
              rows: list[Row]) -> dict[str, Any]:
    """Each row's runs in fresh processes (this command with --rows ROW), alternated over --repeats; each
    row's median run, the ratios of the medians to the baseline's, and every run's figure."""
    def command(side: str, repeat: int, out: str, done: list[fresh.SideRun]) -> list[str]:
        flags = fresh.replay_flags(parser, a, {"--rows": side, "--in-process": True},
                                   skip=("--json", "--repeats"))
        return [*fresh.CLI, "bench", "prefix", *flags, "--json", out]

    names = [r.name for r in rows]
    runs = fresh.run_sides(names, a.repeats, command,
                           describe=lambda run: f"{_tok_s(run.result):.1f} output tok/s, hit rate "
                                                f"{100 * run.result['rows'][0]['prefix_cache']['hit_rate']:.1f} %")
    fresh.check_same_work(runs, lambda r: r["workload"])
    first = runs[0].result
    res = {k: first[k] for k in ("machine", "workload", "engine", "model", "dtype", "threads") if k in first}
    res = {"benchmark": "prefix", "command": command_line(a, parser)} | res
    res["baseline"] = _baseline(a.workload, rows)
    res["rows"] = [fresh.median_run(runs, n, _tok_s).result["rows"][0]
                   | {"output_tokens_per_s_runs": fresh.values(runs, n, _tok_s)} for n in names]
    _ratios(res)
    res["comparison"] = fresh.method(names, a.repeats, runs) | {
        "vs_baseline": {n: fresh.compare(runs, n, res["baseline"], _tok_s) for n in names}}
    return res


def run_here(a: argparse.Namespace, parser: argparse.ArgumentParser | None, params: dict[str, Any],
             rows: list[Row]) -> dict[str, Any]:
    """The rows one after another in this process: what a row's own process does (with one row)."""
    from tdpipe import LLM

    res: dict[str, Any] = {
        "benchmark": "prefix", "command": command_line(a, parser) if parser else None, "pid": os.getpid(),
        "machine": machine_info(), "workload": params, "baseline": _baseline(a.workload, rows), "rows": [],
    }
    reqs: list[wl.BenchRequest] | None = None
    for i, row in enumerate(rows):
        if len(rows) > 1:
            print(f"[{i + 1}/{len(rows)}] {row.name}: {row.label}", file=sys.stderr, flush=True)
        llm = LLM(**_row_kwargs(a, row))
        try:
            engine = llm.engine
            if reqs is None:  # vocabulary and length limit from the first engine; every row shares them
                max_model_len = engine.scheduler.config.max_model_len
                reqs = build_workload(params, engine.model_config.vocab_size, max_model_len)
                res["workload"] |= wl.summarize(reqs) | {"prompt_tokens": sum(r.input_len for r in reqs)}
                res["engine"] = engine_kwargs(a) | {"enable_prefix_caching": "per row",
                                                    "max_model_len": max_model_len}
                res["model"] = engine.model_path
                res["dtype"] = str(engine.dtype).replace("torch.", "")
                res["threads"] = sum(engine.stage_threads)
            r = timed_run(llm, reqs, row)
        finally:
            llm.shutdown()
            del llm
            gc.collect()
        res["rows"].append(r)
        _ratios(res)
        print(f"  {row.name}: {r['elapsed_s']:.2f} s, {r['output_tokens_per_s']:.1f} output tok/s, hit rate "
              f"{100 * r['prefix_cache']['hit_rate']:.1f} %" + ("" if r["complete"] else
                                                                 " (INCOMPLETE: outputs missing)"),
              file=sys.stderr, flush=True)
        if a.json:  # after every row: an interrupted comparison keeps the rows it finished
            _write_json(a.json, res)
    return res


def _ratios(res: dict[str, Any]) -> None:
    """Each row's throughput over the baseline row's (same work in every row, so this is a time ratio)."""
    base = next((r for r in res["rows"] if r["row"] == res["baseline"]), None)
    for r in res["rows"]:
        r["ratio_vs_baseline"] = r["output_tokens_per_s"] / base["output_tokens_per_s"] if base else None


def _write_json(path: str, res: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(res, f, indent=2, default=str)


# -- report --------------------------------------------------------------------------------------------
def format_table(res: dict[str, Any]) -> str:
    """A header naming the workload and machine, then one line per row."""
    w, m = res["workload"], res["machine"]
    if w["name"] == "grpo":
        shape = (f"grpo (seed {w['seed']}): {w['num_prompts']} prompts of {w['input_mean']:.0f} tokens on "
                 f"average x n = {w['n']} samples of {w['output_len']} tokens, temperature 1")
    else:
        shape = (f"shared-prefix (seed {w['seed']}): {w['num_prompts']} requests = {w['prefix_len']}-token "
                 f"shared prefix + {w['question_len'][0]}-{w['question_len'][1]}-token question, "
                 f"{w['output_len']} output tokens, greedy")
    head = [f"workload {shape}",
            f"machine {describe_machine(m)}, {res.get('threads')} threads, {res.get('dtype')}; ratios against "
            f"{res['baseline']!r} (output tok/s, same sitting, "
            + ("one process)" if not (cmp := res.get("comparison")) else "each run in its own process"
               + (f"; medians of {cmp['repeats']} runs per row in alternating order)" if cmp["repeats"] > 1 else ")"))]
    cols = ["row", "caching", "submitted", "elapsed s", "req/s", "out tok/s", "total tok/s", "hit rate",
            "cached tok", "prefill tok", "preempt", "ratio"]
    lines = [cols]
    for r in res["rows"]:
        pc = r["prefix_cache"]
        ratio = "-" if r["ratio_vs_baseline"] is None else f"{r['ratio_vs_baseline']:.2f}x"
        preempt = "-" if r["preemptions"] is None else str(r["preemptions"])
        lines.append([r["row"] + ("" if r["complete"] else " (INCOMPLETE)"),
                      "on" if r["enable_prefix_caching"] else "off", str(r["submitted_requests"]),
                      f"{r['elapsed_s']:.2f}", f"{r['requests_per_s']:.3f}",
                      f"{r['output_tokens_per_s']:.1f}", f"{r['total_tokens_per_s']:.1f}",
                      f"{100 * pc['hit_rate']:.1f} %", str(pc["cached_tokens"]),
                      str(r["prefill_tokens_computed"]), preempt, ratio])
    widths = [max(len(x[k]) for x in lines) for k in range(len(cols))]
    body = ["  ".join(x.ljust(wd) if k == 0 else x.rjust(wd) for k, (x, wd) in enumerate(zip(row, widths)))
            for row in lines]
    notes = [f"{r['row']}: {r['requests_with_missing_samples']} requests returned fewer than n samples, "
             f"{r['samples_with_wrong_length']} samples had another length than asked"
             for r in res["rows"] if not r["complete"]]
    return "\n".join(head + body + notes)


__all__ = ["ROWS", "Row", "add_parser", "build_workload", "check_args", "format_table", "run", "select_rows",
           "submissions", "timed_run", "workload_params"]
