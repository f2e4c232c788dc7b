"""`tdpipe bench llama-cpp`: tdpipe against llama.cpp on the same GGUF file, the same request shape and the
same threads, each run in a process of its own (tdpipe.bench.fresh's rule), sides alternated with repeats.

llama.cpp's side is its `llama-batched-bench` (build it from the `llama-cpp-python` sdist's vendored source:
docs/benchmarks.md): B sequences of PP prompt tokens each are prefilled, then TG tokens are generated for all
of them together, and it reports total tokens / total time. tdpipe's side is `tdpipe bench throughput` with
the fixed workload (B requests of PP random prompt tokens, TG forced output tokens, submitted at once). Both
count prompt + output tokens over the whole run, so the ratio compares like with like. llama.cpp computes on
the quantised blocks; so does tdpipe by default in bf16 (`--quantization auto` keeps a quantised GGUF's 4- and
8-bit blocks packed; `--tdpipe-args "--quantization none"` dequantises the file once to bf16 instead, as `auto`
does for a float32 run).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Any

from tdpipe.bench.fresh import CLI, median, run_order
from tdpipe.bench.machine import machine_info


def tdpipe_side(a: argparse.Namespace) -> dict[str, Any]:
    """One `tdpipe bench throughput` process; its JSON, plus the command."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "tdpipe.json")
        argv = [*CLI, "bench", "throughput", "--model", a.model, "--input-len", str(a.input_len),
                "--output-len", str(a.output_len), "--num-prompts", str(a.num_prompts), "--dtype", a.dtype,
                "--threads", str(a.threads), "--json", out, *shlex.split(a.tdpipe_args)]
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            r = json.load(f)
    return {"argv": argv, "total_tokens_per_s": r["total_tokens_per_s"],
            "output_tokens_per_s": r["output_tokens_per_s"], "elapsed_s": r["elapsed_s"], "raw": r}


def llama_side(a: argparse.Namespace) -> dict[str, Any]:
    """One `llama-batched-bench` process (JSONL output); its line for B = --num-prompts."""
    ctx = a.num_prompts * (a.input_len + a.output_len)
    argv = [a.llama_batched_bench, "-m", a.model, "-c", str(ctx), "-b", "2048", "-ub", "512",
            "-npp", str(a.input_len), "-ntg", str(a.output_len), "-npl", str(a.num_prompts),
            "-t", str(a.threads), "-tb", str(a.threads), "--output-format", "jsonl",
            *shlex.split(a.llama_args)]
    p = subprocess.run(argv, check=True, capture_output=True, text=True)
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    if not lines:
        raise ValueError(f"llama-batched-bench printed no JSONL result: {p.stderr[-400:]}")
    r = lines[-1]
    return {"argv": argv, "total_tokens_per_s": r["speed"],
            "output_tokens_per_s": a.num_prompts * a.output_len / r["t"], "elapsed_s": r["t"],
            "prefill_tokens_per_s": r["speed_pp"], "decode_tokens_per_s": r["speed_tg"], "raw": r}


def cmd(a: argparse.Namespace) -> int:
    if not os.access(a.llama_batched_bench, os.X_OK):
        raise ValueError(f"--llama-batched-bench {a.llama_batched_bench}: not an executable file")
    if not a.model.endswith(".gguf") or not os.path.isfile(a.model):
        raise ValueError(f"--model {a.model}: expected a GGUF file both engines can read")
    runs: dict[str, list[dict[str, Any]]] = {"tdpipe": [], "llama.cpp": []}
    for rep, side in run_order(list(runs), a.repeats):
        t0 = time.perf_counter()
        r = tdpipe_side(a) if side == "tdpipe" else llama_side(a)
        r["repeat"], r["wall_s"] = rep, time.perf_counter() - t0
        runs[side].append(r)
        print(f"repeat {rep} {side:9s}: {r['total_tokens_per_s']:8.1f} total tok/s, "
              f"{r['output_tokens_per_s']:7.1f} output tok/s ({r['elapsed_s']:.1f} s)", file=sys.stderr)
    med = {s: median([r["total_tokens_per_s"] for r in rs]) for s, rs in runs.items()}
    ratio = med["tdpipe"] / med["llama.cpp"]
    print(f"| engine | total tok/s (median of {a.repeats}) | ratio |\n| --- | --- | --- |")
    for s in runs:
        print(f"| {s} | {med[s]:.1f} | {med[s] / med['llama.cpp']:.2f}x |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": os.path.basename(a.model), "input_len": a.input_len, "output_len": a.output_len,
                       "num_prompts": a.num_prompts, "threads": a.threads, "dtype": a.dtype,
                       "repeats": a.repeats, "median_total_tokens_per_s": med, "ratio_tdpipe_to_llama_cpp": ratio,
                       "runs": runs, "machine": machine_info()}, f, indent=1)
    return 0


def add_parser(bsub: Any) -> argparse.ArgumentParser:
    p = bsub.add_parser("llama-cpp", help="tdpipe against llama.cpp's llama-batched-bench on the same GGUF",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the GGUF file both engines run")
    p.add_argument("--llama-batched-bench", required=True, metavar="PATH", help="llama.cpp's llama-batched-bench")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (llama.cpp's -npp)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request (llama.cpp's -ntg)")
    p.add_argument("--num-prompts", type=int, default=256, help="requests, all at once (llama.cpp's -npl)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of both engines")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="tdpipe's compute dtype")
    p.add_argument("--repeats", type=int, default=1, help="runs per side, alternated (A B B A ...)")
    p.add_argument("--tdpipe-args", default="", help="more flags for tdpipe bench throughput, one string")
    p.add_argument("--llama-args", default="", help="more flags for llama-batched-bench, one string")
    p.add_argument("--json", default=None, metavar="FILE", help="also write both sides' runs as JSON")
    p.set_defaults(fn=cmd)
    return p
