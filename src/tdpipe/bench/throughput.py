"""`tdpipe bench throughput`: offline throughput and MFU of the engine on a whole workload at once.

All requests are submitted together (vLLM's benchmark_throughput style) with greedy sampling,
ignore_eos=True and max_tokens=output_len, so every request produces exactly its output_len tokens and
runs are comparable across engines and commits. Model load, the matmul-peak probe and a two-request
warm-up are excluded from the timed region.

--structured-output json puts every request under a JSON schema's token masks (xgrammar), for the cost of
structured output. --compare-pp1 (the same settings at pp = 1, all the workers' threads in one process),
--compare-unconstrained (the same without the schema) and --compare-hf (transformers generate) make this process the orchestrator only: every run of every side is a fresh
`tdpipe bench throughput` process (tdpipe.bench.fresh), the engine side first, the sides alternated over
--repeats, and the table and JSON give each side's median and the ratio of the medians. Running the pp = 1
engine after the pp = 2 one in the same process once measured 284 output tok/s where the same settings alone
gave 398.

MFU = model FLOPs / (elapsed_s * peak FLOP/s), where peak is torch's measured square-matmul rate on the
same threads and dtype (see tdpipe.bench.peak; probed before and after the timed run, the higher taken) and
model FLOPs count only the useful work of the workload (recomputation after preemption is not credited):
  - every processed token (the whole prompt, then each fed-back output token: input_len + output_len - 1
    per request) costs ModelConfig.params_per_token_flops() (2 x decoder weights);
  - attention scores + weighted sum: 4 * context * num_heads * head_dim * num_layers per processed token,
    with context = position + 1;
  - lm_head: 2 * hidden_size * vocab_size per sampled token (one after the prefill, one per decode step:
    output_len per request).
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from tdpipe.bench import fresh
from tdpipe.bench import workload as wl
from tdpipe.bench.machine import describe as describe_machine
from tdpipe.bench.machine import machine_info
from tdpipe.bench.peak import measure_matmul_peak_fresh
from tdpipe.config import ModelConfig
from tdpipe.core.scheduler.registry import get_policy
from tdpipe.entrypoints.args import add_engine_args, engine_kwargs

log = logging.getLogger("tdpipe")

MFU_FORMULA = ("MFU = model FLOPs / (elapsed * peak); model FLOPs per request = "
               "(in + out - 1) * params_per_token_flops "
               "+ sum over processed tokens of 4 * (pos + 1) * heads * head_dim * layers "
               "+ out * 2 * hidden * vocab (lm_head per sampled token)")

# vLLM's ShareGPT sampling drops pairs with prompt + output > 2048; the sharegpt workload keeps that cap.
SHAREGPT_MAX_MODEL_LEN = 2048


# -- FLOP accounting ---------------------------------------------------------------------------------
@dataclass
class Flops:
    """Model FLOPs split by where they go, so a low MFU can be traced to its part."""

    linear: int = 0
    attention: int = 0
    lm_head: int = 0

    @property
    def total(self) -> int:
        return self.linear + self.attention + self.lm_head

    def __add__(self, o: "Flops") -> "Flops":
        return Flops(self.linear + o.linear, self.attention + o.attention, self.lm_head + o.lm_head)


def request_flops(mc: ModelConfig, input_len: int, output_len: int) -> Flops:
    """Useful FLOPs of one request: prefill of input_len tokens, then output_len - 1 decode steps
    (the last sampled token is never fed back)."""
    if input_len < 1 or output_len < 1:
        raise ValueError(f"input_len and output_len must be >= 1, got {input_len}, {output_len}")
    processed = input_len + output_len - 1
    # context of the token at position p is p + 1; positions 0 .. processed - 1 are all processed once
    context_sum = processed * (processed + 1) // 2
    attn_per_ctx = 4 * mc.num_heads * mc.head_dim * mc.num_layers
    return Flops(linear=processed * mc.params_per_token_flops(),
                 attention=context_sum * attn_per_ctx,
                 lm_head=output_len * 2 * mc.hidden_size * mc.vocab_size)


def workload_flops(mc: ModelConfig, lengths: list[tuple[int, int]]) -> Flops:
    total = Flops()
    for i, o in lengths:
        total = total + request_flops(mc, i, o)
    return total


# -- CLI -----------------------------------------------------------------------------------------------
def add_parser(bsub: Any) -> argparse.ArgumentParser:
    p = bsub.add_parser(
        "throughput", help="offline throughput and MFU on a synthetic or JSONL workload",
        description="Submit a whole workload at once and report requests/s, tokens/s and MFU. Output "
                    "lengths are forced (greedy, ignore_eos). " + MFU_FORMULA + ".")
    wl.add_workload_args(p)
    p.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    p.add_argument("--compare-hf", action="store_true",
                   help="also run the requests through transformers generate (static batches) and report "
                        "the ratio; every run, of either side, in a fresh process of its own")
    p.add_argument("--hf-batch-size", type=int, default=32, help="batch size of the transformers baseline")
    p.add_argument("--compare-pp1", action="store_true",
                   help="with --pp N > 1 (or --tp N > 1): also run the same workload on pp = 1 with all the "
                        "workers' threads in one process, and report the throughput ratio; every run, of either "
                        "side, in a fresh process of its own")
    p.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="with --compare-pp1 / --compare-hf: run every side N times, in alternating order (A B, "
                        "B A, ...), and compare the medians (default: %(default)s)")
    p.add_argument("--structured-output", choices=("none", "json"), default="none",
                   help="json: every request follows a JSON schema (an array of at least 1,000 records of an "
                        "integer id and a string name, so no grammar can end before the forced output length), "
                        "sampled through xgrammar's token masks; none: unconstrained (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="every request sampled at temperature T over the whole vocabulary (the exponential race "
                        "of the engine's sampler; vLLM's benchmark_throughput samples at 1.0); 0: greedy "
                        "(default: %(default)s)")
    p.add_argument("--compare-unconstrained", action="store_true",
                   help="with --structured-output json: also run the same workload unconstrained and report "
                        "the throughput ratio; every run, of either side, in a fresh process of its own")
    p.add_argument("--compare-dp1", action="store_true",
                   help="with --data-parallel-size N > 1: also run the same workload on one engine with all the "
                        "replicas' threads, and report the throughput ratio; every run, of either side, in a "
                        "fresh process of its own")
    p.add_argument("--hf-only", action="store_true", help=argparse.SUPPRESS)  # --compare-hf's side process
    add_engine_args(p)
    p.set_defaults(fn=lambda a: run(a, p))
    return p


def build_workload(a: argparse.Namespace, vocab_size: int, max_model_len: int,
                   tokenizer: Any = None) -> tuple[str, list[wl.BenchRequest]]:
    """Pick and build the workload from the flags; fails early with a message naming the flag."""
    if a.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {a.num_prompts}")
    fixed_lens = a.input_len is not None or a.output_len is not None
    if getattr(a, "history", None):
        if a.dataset or fixed_lens:
            raise ValueError("--history sets the prompts and lengths itself; drop --dataset/--input-len/--output-len")
        reqs = wl.from_history(a.history, tokenizer, a.history_split, limit=a.num_prompts)
        name = f"history:{a.history} ({a.history_split} split)"
    elif a.dataset:
        if fixed_lens:
            raise ValueError("--dataset sets the lengths itself; drop --input-len/--output-len")
        reqs = wl.from_jsonl(a.dataset, tokenizer, limit=a.num_prompts)
        name = f"dataset:{a.dataset}"
    elif fixed_lens or a.workload == "fixed":
        if a.input_len is None or a.output_len is None:
            raise ValueError("the fixed workload needs both --input-len and --output-len")
        if a.input_len + a.output_len > max_model_len:
            raise ValueError(f"--input-len + --output-len = {a.input_len + a.output_len} exceeds max_model_len "
                             f"{max_model_len}")
        reqs = wl.fixed(a.num_prompts, a.input_len, a.output_len, vocab_size, a.workload_seed)
        name = "fixed"
    else:
        reqs = wl.sharegpt_like(a.num_prompts, vocab_size, a.workload_seed,
                                min(max_model_len, SHAREGPT_MAX_MODEL_LEN))
        name = "sharegpt"
    for k, r in enumerate(reqs):
        if r.input_len >= max_model_len or r.input_len + r.output_len > max_model_len:
            raise ValueError(f"request {k}: {r.input_len} prompt + {r.output_len} output tokens do not fit "
                             f"max_model_len {max_model_len}")
        if max(r.prompt_token_ids) >= vocab_size or min(r.prompt_token_ids) < 0:
            raise ValueError(f"request {k}: prompt token ids must be in [0, {vocab_size})")
    return name, reqs


# --structured-output json: records that cannot all fit in any forced output length, so every token of every
# request is sampled under the grammar's mask (a grammar that ended would leave the rest unconstrained)
RECORDS_SCHEMA = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string"}},
    "required": ["id", "name"]}}


def _params(output_len: int, structured: str = "none", temperature: float = 0.0) -> Any:
    from tdpipe.sampling.params import SamplingParams

    so = {"json": RECORDS_SCHEMA} if structured == "json" else None
    return SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=output_len, structured_outputs=so)


def preflight(a: argparse.Namespace) -> None:
    """Every path the run reads or writes, checked before the model loads: a missing --dataset fails in a
    second, and a --json in a missing directory no longer loses a whole benchmark's results at the end."""
    from tdpipe.entrypoints.preflight import check_model, check_readable, check_writable

    check_model(getattr(a, "model", None))
    check_readable(getattr(a, "dataset", None), "--dataset")
    check_readable(getattr(a, "history", None), "--history")
    check_writable(getattr(a, "json", None), "--json")
    check_writable(getattr(a, "trace", None), "--trace")
    check_writable(getattr(a, "record_history", None), "--record-history")


def run(a: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """One engine run in this process; with --compare-pp1 / --compare-hf, every side (the engine as asked,
    pp = 1, transformers) in fresh processes of their own instead (tdpipe.bench.fresh)."""
    preflight(a)
    if a.hf_batch_size < 1:
        raise ValueError(f"--hf-batch-size must be >= 1, got {a.hf_batch_size}")
    if a.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {a.repeats}")
    if not a.temperature >= 0:
        raise ValueError(f"--temperature must be >= 0, got {a.temperature}")
    if a.temperature > 0 and (a.compare_hf or a.hf_only):
        raise ValueError("--compare-hf runs transformers greedy: use it with --temperature 0")
    if a.hf_only:
        res = run_hf_side(a, fresh.flag_value(parser, a, "--threads") if parser else None)
    elif a.compare_pp1 or a.compare_hf or a.compare_unconstrained or a.compare_dp1:
        if a.compare_dp1 and a.data_parallel_size <= 1:
            raise ValueError("--compare-dp1 needs --data-parallel-size > 1")
        if a.compare_unconstrained and a.structured_output == "none":
            raise ValueError("--compare-unconstrained needs --structured-output json")
        if a.compare_pp1 and a.pipeline_parallel_size * a.tensor_parallel_size <= 1:
            raise ValueError("--compare-pp1 needs --pp > 1 or --tp > 1")
        if parser is None:
            raise ValueError("the --compare-* flags run from the command line (`tdpipe bench throughput`)")
        res = run_compared(a, parser)
    else:
        if a.repeats != 1:
            raise ValueError("--repeats applies to the --compare-* flags (one run needs no repeat)")
        res = run_engine(a)
    if not a.hf_only:
        print(format_table(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2, default=str)
    return 0


def run_engine(a: argparse.Namespace) -> dict[str, Any]:
    """The engine the flags describe, in this process: load, peak, warm-up, the timed run; its result."""
    from tdpipe import LLM

    llm = LLM(**engine_kwargs(a), collect_trace=True)  # the bubble ratios come from the trace
    try:
        return _engine_result(a, llm) if llm.engine is not None else _replicated_result(a, llm)
    finally:
        llm.shutdown()


def _replicated_result(a: argparse.Namespace, llm: Any) -> dict[str, Any]:
    """--data-parallel-size N > 1: the same workload through the N replicas (other processes); throughput
    only (each replica's steps, trace and MFU stay in its own process), with how the work was spread."""
    client = llm.replicas.client
    name, reqs = build_workload(a, client.vocab_size, client.max_model_len, client.tokenizer)
    warm = [{"prompt_token_ids": r.prompt_token_ids[:8]} for r in reqs[:2 * len(client.replicas)]]
    llm.generate(warm, [_params(2, a.structured_output, a.temperature) for _ in warm], use_tqdm=False)
    before = [s["generation_tokens"] for s in client.stats()["replicas"]]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} | ({"prompt": r.text} if r.text else {}) for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, [_params(r.output_len, a.structured_output, a.temperature) for r in reqs],
                        use_tqdm=sys.stderr.isatty())
    elapsed = time.perf_counter() - t0
    errors = [o.error for o in outs if o.error]
    if errors:
        raise ValueError(f"{len(errors)} of {len(outs)} requests failed; first: {errors[0]}")
    time.sleep(1.5)  # the replicas' stats snapshots (sent every step, once a second when idle) catch up
    per = [s["generation_tokens"] - b for s, b in zip(client.stats()["replicas"], before)]
    in_tok = sum(r.input_len for r in reqs)
    out_tok = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "requests_per_s": len(reqs) / elapsed, "input_tokens_per_s": in_tok / elapsed,
        "output_tokens_per_s": out_tok / elapsed, "total_tokens_per_s": (in_tok + out_tok) / elapsed,
        "elapsed_s": elapsed, "num_requests": len(reqs), "total_input_tokens": in_tok,
        "total_output_tokens": out_tok, "data_parallel_size": len(client.replicas),
        "replica_cpus": [r.cpus for r in client.replicas], "replica_output_tokens": per,
        "threads": sum(len(r.cpus) for r in client.replicas), "dtype": a.dtype,
        "structured_output": a.structured_output, "temperature": a.temperature, "machine": machine_info(),
        "pid": os.getpid(),
        "model": client.replicas[0].config.model, "workload": {"name": name, "seed": a.workload_seed,
                                                              **wl.summarize(reqs)},
        "engine": engine_kwargs(a) | {"max_model_len": client.max_model_len},
    }


def _engine_result(a: argparse.Namespace, llm: Any) -> dict[str, Any]:
    engine = llm.engine
    mc = engine.model_config
    max_model_len = engine.scheduler.config.max_model_len
    name, reqs = build_workload(a, mc.vocab_size, max_model_len, engine.tokenizer)
    threads = sum(engine.stage_threads) * engine.tp  # compute threads over all P x T workers
    dtype_name = str(engine.dtype).replace("torch.", "")

    before = measure_matmul_peak_fresh(engine.dtype, threads)  # the peak of every core the stages use
    print(f"matmul peak ({dtype_name}, {threads} threads): {before:.1f} GFLOP/s", file=sys.stderr, flush=True)

    timed = _timed_run(llm, reqs, a.structured_output, a.temperature)
    elapsed, outs, s = timed["elapsed"], timed["outs"], timed["stats"]
    # probed again once the run is over, and the higher taken: anything else on the cores lowers a probe (one
    # sitting's pp = 2 runs read half the peak before their runs, start-up work of the stages most likely,
    # and reported an MFU of 81% on it)
    after = measure_matmul_peak_fresh(engine.dtype, threads)
    peak = max(before, after)
    if after > 1.25 * before or before > 1.25 * after:
        print(f"matmul peak probed again after the run: {after:.1f} GFLOP/s; MFU uses {peak:.1f}", file=sys.stderr,
              flush=True)

    errors = [o.error for o in outs if o.error]
    if errors:
        raise ValueError(f"{len(errors)} of {len(outs)} requests failed; first: {errors[0]}")
    got = [len(o.outputs[0].token_ids) for o in outs]
    short = [k for k, (g, r) in enumerate(zip(got, reqs)) if g != r.output_len]
    if short:
        log.warning("%d requests produced a different number of tokens than asked (first: request %d, %d vs %d)",
                    len(short), short[0], got[short[0]], reqs[short[0]].output_len)
    in_tok = sum(r.input_len for r in reqs)
    out_tok = sum(got)
    flops = workload_flops(mc, [(r.input_len, g) for r, g in zip(reqs, got)])
    return {
        "requests_per_s": len(reqs) / elapsed,
        "input_tokens_per_s": in_tok / elapsed,
        "output_tokens_per_s": out_tok / elapsed,
        "total_tokens_per_s": (in_tok + out_tok) / elapsed,
        "mfu": flops.total / (elapsed * peak * 1e9),
        "achieved_gflops": flops.total / elapsed / 1e9,
        "elapsed_s": elapsed,
        # CPU seconds of the engine process over the run: with pp > 1 the control plane alone (scheduling,
        # sampling, prediction, transport), which on a CPU server competes with the stages for cores
        "engine_cpu_s": timed["engine_cpu_s"],
        "num_requests": len(reqs),
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        **{name: s[name] for name in get_policy(engine.scheduler.config.policy).stat_names},  # preemptions, ...
        "prefill_steps": s["prefill_steps"],
        "decode_steps": s["decode_steps"],
        "mixed_steps": s["mixed_steps"],
        "predictor": _predictor_cost(engine, s, elapsed, len(reqs)),
        "kv_blocks": engine.block_manager.num_blocks,
        "kv_capacity_tokens": engine.block_manager.num_blocks * engine.block_manager.block_size,
        "pp": engine.pp,
        "tp": engine.tp,
        "policy": engine.scheduler.config.policy,
        "layer_partition": [b - a_ for a_, b in engine.partition],
        "lm_head_split": engine.lm_head_split,  # the share of the head on stage 0 (auto: as chosen)
        "stage_threads": engine.stage_threads,
        "bubble_ratio": timed["summary"]["bubble_ratio"],
        "bubble_ratio_per_stage": timed["summary"]["bubble_ratio_per_stage"],
        "decode_bubble_ratio": timed["summary"]["decode_bubble_ratio"],
        # tensor parallelism: per stage, the all-reduce seconds of the run and of one micro-batch (trace)
        "allreduce_s_per_stage": timed["summary"]["allreduce_s"],
        "allreduce_ms_per_step": [1e3 * x for x in timed["summary"]["mean_allreduce_s"]],
        "busy_s_per_stage": timed["summary"]["busy_s"],
        "step_costs": _step_costs(engine),
        "peak_gflops": peak,
        "peak_probes_gflops": [before, after],  # before and after the timed run
        "model_flops": asdict(flops) | {"total": flops.total},
        "mfu_formula": MFU_FORMULA,
        "dtype": dtype_name,
        "threads": threads,
        "structured_output": a.structured_output, "temperature": a.temperature,
        "machine": machine_info(),
        "pid": os.getpid(),
        "model": engine.model_path,
        "workload": {"name": name, "seed": a.workload_seed, **wl.summarize(reqs)},
        "engine": {k: v for k, v in engine_kwargs(a).items()} | {"max_model_len": max_model_len},
    }


# -- the fair comparison: each side in its own process ---------------------------------------------------------
# options that only steer the comparison itself; a side never gets them
COMPARE_ONLY = ("--compare-pp1", "--compare-hf", "--compare-unconstrained", "--compare-dp1", "--repeats", "--json",
                "--hf-only")


def pp1_overrides(threads: int) -> dict[str, Any]:
    """--compare-pp1's side: the same settings as one process with all `threads` the pipeline's workers use;
    layout-only settings (partition, lm_head split across stages, threads per worker, micro-batches in flight)
    dropped, since they do not exist at pp = 1, and no trace or history file written a second time."""
    return {"--pp": 1, "--tp": 1, "--layer-partition": None, "--lm-head-split": 0.0, "--threads-per-stage": None,
            "--pipeline-depth": None, "--threads": threads, "--trace": None, "--record-history": None}


def hf_overrides(first: dict[str, Any]) -> dict[str, Any]:
    """--compare-hf's side: transformers on the engine side's model folder, dtype, threads and context length
    (so it builds the same workload), nothing of the engine."""
    return {"--hf-only": True, "--model": first["model"], "--dtype": first["dtype"], "--threads": first["threads"],
            "--max-model-len": first["engine"]["max_model_len"], "--trace": None, "--record-history": None}


def side_command(a: argparse.Namespace, parser: argparse.ArgumentParser, side: str, out: str,
                 runs: list[fresh.SideRun]) -> list[str]:
    """The `tdpipe bench throughput` command of one run of a side, writing its JSON to `out`."""
    over: dict[str, Any] = {}
    if side != "engine":  # the engine side always runs first (fresh.run_order), so its settings are known
        first = next(r.result for r in runs if r.side == "engine")
        over = {"pp1": lambda: pp1_overrides(first["threads"]), "hf": lambda: hf_overrides(first),
                "free": lambda: {"--structured-output": "none"},
                "dp1": lambda: {"--dp": 1, "--threads": first["threads"]}}[side]()
    skip = [k for k in COMPARE_ONLY if k not in over]
    return [*fresh.CLI, "bench", "throughput", *fresh.replay_flags(parser, a, over, skip=skip), "--json", out]


def _tok_s(r: dict[str, Any]) -> float:
    return r["output_tokens_per_s"]


def run_compared(a: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Every side in fresh processes, alternated over --repeats; the engine side's median run with each
    other side's median and the ratios of the medians (and per repeat)."""
    sides = (["engine"] + ["pp1"] * a.compare_pp1 + ["hf"] * a.compare_hf + ["free"] * a.compare_unconstrained
             + ["dp1"] * a.compare_dp1)
    runs = fresh.run_sides(sides, a.repeats, lambda side, r, out, done: side_command(a, parser, side, out, done),
                           describe=lambda run: f"{_tok_s(run.result):.1f} output tok/s")
    fresh.check_same_work(runs, lambda r: (r["workload"], r["num_requests"], r["total_input_tokens"]))
    res = dict(fresh.median_run(runs, "engine", _tok_s).result)
    res["output_tokens_per_s_runs"] = fresh.values(runs, "engine", _tok_s)
    res["comparison"] = fresh.method(sides, a.repeats, runs)
    if a.compare_pp1:
        _compared(res, runs, "pp1", "pp1")
        base = fresh.median_run(runs, "pp1", _tok_s).result
        res |= {"pp1_elapsed_s": base["elapsed_s"], "pp1_bubble_ratio": base["bubble_ratio"],
                "pp1_threads": base["threads"], "pp1_mfu": base["mfu"]}
    if a.compare_dp1:
        _compared(res, runs, "dp1", "dp1")
    if a.compare_unconstrained:
        _compared(res, runs, "free", "unconstrained")
    if a.compare_hf:  # its median side's own hf_* figures (hf_output_tokens_per_s among them: useful tokens)
        res |= {k: v for k, v in fresh.median_run(runs, "hf", _tok_s).result.items() if k.startswith("hf_")}
        _compared(res, runs, "hf", "hf", median=False)
    return res


def _compared(res: dict[str, Any], runs: list[fresh.SideRun], side: str, name: str, median: bool = True) -> None:
    """Into `res`: the engine side against `side` (the comparison, and `name`'s runs, median and ratios)."""
    c = fresh.compare(runs, "engine", side, _tok_s)
    res["comparison"][side] = c
    if median:
        res[f"{name}_output_tokens_per_s"] = c["base_median"]
    res |= {f"{name}_output_tokens_per_s_runs": c["base_values"], f"ratio_vs_{name}": c["ratio"],
            f"ratio_vs_{name}_per_repeat": c["ratio_per_repeat"]}


def run_hf_side(a: argparse.Namespace, threads: int | None) -> dict[str, Any]:
    """--compare-hf's side, in its own process: the workload built as the engine side built it (same model
    folder, vocabulary, context length and tokenizer), then transformers generate on it."""
    from tdpipe.model.bundled import resolve_model
    from tdpipe.tokenizer import load_tokenizer

    path = resolve_model(a.model)
    vocab, max_pos = wl.model_vocab(path)
    tok = load_tokenizer(path)
    name, reqs = build_workload(a, vocab, a.max_model_len or max_pos, tok)
    threads = threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    dtype = getattr(torch, a.dtype) if a.dtype in ("bfloat16", "float32") else torch.float32
    pad = tok.eos_token_id if tok.eos_token_id is not None else 0
    hf = run_hf(path, reqs, a.hf_batch_size, dtype, pad)
    return hf | {"output_tokens_per_s": hf["hf_output_tokens_per_s"], "elapsed_s": hf["hf_elapsed_s"],
                 "num_requests": len(reqs), "total_input_tokens": sum(r.input_len for r in reqs),
                 "threads": threads, "dtype": str(dtype).replace("torch.", ""), "model": path,
                 "machine": machine_info(), "pid": os.getpid(),
                 "workload": {"name": name, "seed": a.workload_seed, **wl.summarize(reqs)}}


def _predictor_cost(engine: Any, s: dict[str, Any], elapsed: float, n: int) -> dict[str, Any] | None:
    """Policies that predict output lengths (td-pipe): which predictor ran and what batched length prediction
    cost, per request and against the engine's wall time per request (the issue's bar: under 5%)."""
    if not get_policy(engine.scheduler.config.policy).needs_predictor:
        return None
    p = engine.predictor
    name = getattr(p, "name", type(p).__name__)
    if getattr(p, "fallback", None) is not None:
        name += "+" + p.fallback.name
    out = {"spec": engine.scheduler.config.predictor, "name": name, "seconds": s["predict_seconds"],
           "predicted": s["predicted"], "predicted_in_batches": s["predicted_in_batches"]}
    if s["predicted"]:
        per = s["predict_seconds"] / s["predicted"]
        out |= {"ms_per_request": 1e3 * per, "share_of_engine_time_per_request": per / (elapsed / n)}
    return out


def _learned(engine: Any) -> Any:
    """The learned predictor behind the engine's predictor, if any (it keeps its own time and count)."""
    for p in (engine.predictor, getattr(engine.predictor, "fallback", None)):
        if p is not None and hasattr(p, "seconds") and hasattr(p, "count"):
            return p
    return None


def _step_costs(engine: Any) -> dict[str, Any] | None:
    """Policies that use step costs (td-pipe's Eq. 1-2): the fitted lines and where they came from (profile,
    cache, default)."""
    sched = engine.scheduler
    if not get_policy(sched.config.policy).wants_step_costs(sched.config):
        return None
    c = sched.costs
    return {"d0": c.d0, "d1": c.d1, "p0": c.p0, "p1": c.p1, "peak_batch": c.peak_batch, "source": c.source}


def _timed_run(llm: Any, reqs: list[wl.BenchRequest], structured: str = "none",
               temperature: float = 0.0) -> dict[str, Any]:
    """Warm up (kernel JIT, allocator, worker start-up stay out of the timing), then run the whole workload
    at once; returns the elapsed time, outputs, step counts and the trace summary (bubble ratios)."""
    from tdpipe.viz.timeline import summarize

    engine = llm.engine
    warm = [{"prompt_token_ids": r.prompt_token_ids[:8]} for r in reqs[:2]]
    llm.generate(warm, [_params(2, structured, temperature) for _ in warm], use_tqdm=False)  # the grammar too
    st = engine.stats
    sched = engine.scheduler
    model = _learned(engine)  # every prediction the model made, batched or one by one
    spec = get_policy(sched.config.policy)
    before = (spec.read_stats(sched), st.prefill_steps, st.decode_steps, st.mixed_steps,
              model.seconds if model else 0.0, model.count if model else 0, st.predicted)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} | ({"prompt": r.text} if r.text else {}) for r in reqs]
    t0, cpu0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, [_params(r.output_len, structured, temperature) for r in reqs],
                        use_tqdm=sys.stderr.isatty())
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    after = (spec.read_stats(sched), st.prefill_steps, st.decode_steps, st.mixed_steps,
             model.seconds if model else 0.0, model.count if model else 0, st.predicted)
    keys = ("prefill_steps", "decode_steps", "mixed_steps", "predict_seconds", "predicted", "predicted_in_batches")
    stats = {k: v - before[0][k] for k, v in after[0].items()}  # the policy's counters (preemptions, ...)
    stats |= {k: b - a for k, a, b in zip(keys, before[1:], after[1:])}
    return {"elapsed": elapsed, "outs": outs, "summary": summarize(llm.trace()), "engine_cpu_s": cpu,
            "stats": stats}


# -- transformers baseline -----------------------------------------------------------------------------
def hf_batches(reqs: list[wl.BenchRequest], batch_size: int) -> list[list[int]]:
    """Indices of `reqs` in static batches. Sorted by (output_len, input_len) first, so a fixed workload
    gets batches of equal output length and a variable one wastes as little as a static batcher can; this
    sort uses the output lengths as an oracle, which favours HF and makes ratio_vs_hf conservative."""
    order = sorted(range(len(reqs)), key=lambda k: (reqs[k].output_len, reqs[k].input_len))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def _left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for k, r in enumerate(rows):
        ids[k, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[k, width - len(r):] = 1
    return ids, mask


def run_hf(model_path: str, reqs: list[wl.BenchRequest], batch_size: int, dtype: torch.dtype,
           pad_id: int, device: str = "cpu") -> dict[str, Any]:
    """transformers generate on the same requests: static, left-padded batches, greedy, each batch forced
    to exactly its largest output_len (min_new_tokens = max_new_tokens). Only each request's own output_len
    counts as useful output; the extra tokens generated for shorter requests in a batch are waste, reported
    as hf_generated_tokens. Same torch threads and dtype as the engine; load and warm-up are not timed.
    `device`: where the model runs (tdpipe gpu-check: "cuda")."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    model.eval()

    def gen(rows: list[list[int]], n: int) -> None:
        ids, mask = (t.to(device) for t in _left_pad(rows, pad_id))
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=pad_id, temperature=None, top_p=None, top_k=None)
        if out.shape[1] - ids.shape[1] != n:  # the baseline must do the work it is credited with
            raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens, expected {n}")

    try:
        gen([r.prompt_token_ids[:8] for r in reqs[:2]], 2)
        batches = hf_batches(reqs, batch_size)
        generated = 0
        t0 = time.perf_counter()
        for b in batches:
            n = max(reqs[k].output_len for k in b)
            gen([reqs[k].prompt_token_ids for k in b], n)
            generated += n * len(b)
        if device != "cpu":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    finally:
        model = None  # drop the weights before the caller goes on
        gc.collect()
    useful = sum(r.output_len for r in reqs)
    return {"hf_output_tokens_per_s": useful / elapsed, "hf_elapsed_s": elapsed,
            "hf_total_tokens_per_s": (useful + sum(r.input_len for r in reqs)) / elapsed,
            "hf_batch_size": batch_size, "hf_num_batches": len(batches), "hf_generated_tokens": generated,
            "hf_useful_output_tokens": useful}


# -- report --------------------------------------------------------------------------------------------
def format_table(r: dict[str, Any]) -> str:
    w = r["workload"]
    m = r["machine"]
    if r.get("data_parallel_size", 1) > 1:
        return _replicated_table(r)
    rows = [
        ("workload", f"{w['name']} (seed {w['seed']}): {r['num_requests']} requests, input mean "
                     f"{w['input_mean']:.1f} / median {w['input_median']:.0f}, output mean {w['output_mean']:.1f}"
                     f" / median {w['output_median']:.0f}"),
        ("machine", f"{describe_machine(m)}, {r['threads']} threads, {r['dtype']}"),
        ("elapsed", f"{r['elapsed_s']:.2f} s"),
        ("requests/s", f"{r['requests_per_s']:.3f}"),
        ("input tokens/s", f"{r['input_tokens_per_s']:.1f}  ({r['total_input_tokens']} tokens)"),
        ("output tokens/s", f"{r['output_tokens_per_s']:.1f}  ({r['total_output_tokens']} tokens)"),
        ("total tokens/s", f"{r['total_tokens_per_s']:.1f}"),
        ("layout", f"pp {r['pp']} x tp {r.get('tp', 1)}, layers {r['layer_partition']}"
                   + (f", {100 * r['lm_head_split']:.0f}% of the lm_head on stage 0" if r.get("lm_head_split") else "")
                   + f", threads per worker {r['stage_threads']}, policy {r['policy']}"),
        ("steps", f"{r['prefill_steps']} prefill, {r['decode_steps']} decode, {r['mixed_steps']} mixed; "
                  + get_policy(r["policy"]).stats_text(r)),
        ("KV cache", f"{r['kv_blocks']} blocks, {r['kv_capacity_tokens']} tokens"),
        ("engine CPU", f"{r['engine_cpu_s']:.1f} s = {100 * r['engine_cpu_s'] / r['elapsed_s']:.1f} % of elapsed"
                       + (" (control plane only: the stages are other processes)" if r["pp"] * r.get("tp", 1) > 1
                          else " (engine and model in one process)")),
    ]
    pc = r.get("predictor")
    if pc:
        cost = (f"; {pc['predicted']} predicted ({pc['predicted_in_batches']} in batches as they arrived), "
                f"{pc['ms_per_request']:.2f} ms per request = "
                f"{100 * pc['share_of_engine_time_per_request']:.2f} % of the engine's time per request"
                if pc["predicted"] else "")
        rows.append(("predictor", f"{pc['spec']} ({pc['name']}){cost}"))
    rows += [
        ("bubble ratio", f"{r['bubble_ratio']:.3f} mean (idle / wall per stage: "
                         f"{', '.join(f'{b:.3f}' for b in r['bubble_ratio_per_stage'])}); decode-only phase "
                         + ("-" if r['decode_bubble_ratio'] is None else f"{r['decode_bubble_ratio']:.3f}")),
    ]
    if r.get("tp", 1) > 1:
        busy = r["busy_s_per_stage"]
        rows.append(("all-reduce", "per stage " + ", ".join(
            f"{ar:.1f} s = {100 * ar / b:.1f} % of busy, {ms:.2f} ms/step"
            for ar, b, ms in zip(r["allreduce_s_per_stage"], busy, r["allreduce_ms_per_step"]) if b)))
    rows += [
        ("model FLOPs", f"{r['model_flops']['total'] / 1e12:.3f} TFLOP (linear {r['model_flops']['linear'] / 1e12:.3f}"
                        f", attention {r['model_flops']['attention'] / 1e12:.3f}, lm_head "
                        f"{r['model_flops']['lm_head'] / 1e12:.3f})"),
        ("achieved", f"{r['achieved_gflops']:.1f} GFLOP/s"),
        ("matmul peak", f"{r['peak_gflops']:.1f} GFLOP/s"),
        ("MFU", f"{100 * r['mfu']:.1f} %"),
    ]
    cmp = r.get("comparison")
    if cmp:
        rows.append(("compared", f"each run in its own process; {cmp['repeats']} run(s) per side, order "
                                 f"{' '.join(cmp['order'])}; figures are medians"))
        if len(r.get("output_tokens_per_s_runs", [])) > 1:
            rows.append(("output tok/s runs", _runs(r["output_tokens_per_s_runs"])))
    if "hf_output_tokens_per_s" in r:
        rows += [
            ("HF elapsed", f"{r['hf_elapsed_s']:.2f} s  ({r['hf_num_batches']} batches of <= {r['hf_batch_size']}, "
                           f"{r['hf_generated_tokens']} generated / {r['hf_useful_output_tokens']} useful)"),
            ("HF output tokens/s", f"{r['hf_output_tokens_per_s']:.1f}  (useful tokens only"
                                   f"{_runs_of(r, 'hf_output_tokens_per_s_runs')})"),
            ("ratio vs HF", f"{r['ratio_vs_hf']:.2f}x  (output tokens/s{_per_repeat(r, 'ratio_vs_hf_per_repeat')})"),
        ]
    if "ratio_vs_pp1" in r:
        rows += [
            ("pp=1 output tok/s", f"{r['pp1_output_tokens_per_s']:.1f}  ({r['pp1_threads']} threads, one process; "
                                  f"bubble {r['pp1_bubble_ratio']:.3f}{_runs_of(r, 'pp1_output_tokens_per_s_runs')})"),
            ("ratio vs pp=1", f"{r['ratio_vs_pp1']:.3f}x  (output tokens/s, same workload, same sitting, "
                              + ("each run in its own process" if cmp else "pp=1 after pp=n in one process: biased")
                              + f"{_per_repeat(r, 'ratio_vs_pp1_per_repeat')})"),
        ]
    if r.get("temperature", 0.0) > 0:
        rows.append(("sampling", f"temperature {r['temperature']:g}, whole vocabulary"))
    if r.get("structured_output", "none") != "none":
        rows.append(("structured output", f"{r['structured_output']}: every request under a JSON schema's "
                                          "token masks"))
    if "ratio_vs_unconstrained" in r:
        rows += [
            ("unconstrained tok/s", f"{r['unconstrained_output_tokens_per_s']:.1f}"
                                    + _runs_of(r, "unconstrained_output_tokens_per_s_runs", "  (runs ", ")")),
            ("ratio vs unconstrained", f"{r['ratio_vs_unconstrained']:.3f}x  (output tokens/s, same workload"
                                       f"{_per_repeat(r, 'ratio_vs_unconstrained_per_repeat')})"),
        ]
    return _aligned(rows) + "\n" + MFU_FORMULA


def _replicated_table(r: dict[str, Any]) -> str:
    """--data-parallel-size N: throughput and the spread over the replicas (and the dp = 1 comparison)."""
    w = r["workload"]
    rows = [
        ("workload", f"{w['name']} (seed {w['seed']}): {r['num_requests']} requests, input mean "
                     f"{w['input_mean']:.1f}, output mean {w['output_mean']:.1f}"),
        ("machine", f"{describe_machine(r['machine'])}, {r['threads']} threads, {r['dtype']}"),
        ("replicas", f"{r['data_parallel_size']}, on cores " + " | ".join(",".join(map(str, c))
                                                                        for c in r["replica_cpus"])
                     + "; output tokens per replica " + ", ".join(map(str, r["replica_output_tokens"]))),
        ("elapsed", f"{r['elapsed_s']:.2f} s"),
        ("output tokens/s", f"{r['output_tokens_per_s']:.1f}  ({r['total_output_tokens']} tokens)"
                            + _runs_of(r, "output_tokens_per_s_runs")),
        ("total tokens/s", f"{r['total_tokens_per_s']:.1f}"),
    ]
    if "ratio_vs_dp1" in r:
        rows += [
            ("one engine tok/s", f"{r['dp1_output_tokens_per_s']:.1f}  (all {r['threads']} threads, one engine"
                                 f"{_runs_of(r, 'dp1_output_tokens_per_s_runs')})"),
            ("ratio vs one engine", f"{r['ratio_vs_dp1']:.3f}x  (output tokens/s, same workload, each run in its "
                                    f"own process{_per_repeat(r, 'ratio_vs_dp1_per_repeat')})"),
        ]
    return _aligned(rows)


def _aligned(rows: list[tuple[str, str]]) -> str:
    """The table's rows, their labels padded to one width."""
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _runs(xs: list[float]) -> str:
    return ", ".join(f"{x:.1f}" for x in xs)


def _runs_of(r: dict[str, Any], key: str, before: str = "; runs ", after: str = "") -> str:
    """`before` + the runs under `key` + `after` when there are several; "" for one run or none."""
    xs = r.get(key) or []
    return f"{before}{_runs(xs)}{after}" if len(xs) > 1 else ""


def _per_repeat(r: dict[str, Any], key: str) -> str:
    xs = r.get(key) or []
    return "; per repeat " + ", ".join(f"{x:.3f}x" for x in xs) if len(xs) > 1 else ""
