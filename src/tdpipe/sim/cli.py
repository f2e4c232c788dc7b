"""`tdpipe simulate`: run a workload through the real engine and scheduler on simulated hardware."""
from __future__ import annotations

import argparse
import json
from typing import Any

from tdpipe.engine_args import EngineArgs, parse_memory, parse_partition


def add_parser(sub: Any) -> argparse.ArgumentParser:
    from tdpipe.sim.hardware import NAMES
    from tdpipe.sim.runner import model_names

    p = sub.add_parser(
        "simulate", help="simulate the engine on GPUs/CPUs it does not run on (TD-Pipe §4 at scale)",
        description="The real engine, scheduler and block manager over a simulated executor: a virtual clock and a "
                    "roofline cost model per layer (docs/simulator.md). Reports throughput, bubble ratio per stage "
                    "and KV usage over time; --trace writes the runtime's trace format for `tdpipe plot timeline`. "
                    "--figure11 runs TD-Pipe's Figure 11 grid; --compare replays real bench runs on the calibrated "
                    "CPU model.")
    g = p.add_argument_group("deployment")
    g.add_argument("--hardware", default=None,
                   help=f"device kind: {', '.join(NAMES)} (this machine, calibrated on first use and cached), or a "
                        "JSON file with tdpipe.sim.hardware.Hardware's fields (default a100-80g; the studies: their "
                        "papers' own)")
    g.add_argument("--pp", type=int, default=None, metavar="P",
                   help="pipeline stages, each a group of --tp devices (the runtime's --pp); devices = P x T")
    g.add_argument("--tp", type=int, default=None, metavar="T",
                   help="tensor-parallel devices per stage, two all-reduces per layer (the runtime's --tp)")
    g.add_argument("--num-devices", type=int, default=None,
                   help="devices (GPUs; for cpu: groups of threads); with --parallel, a shorthand for --pp N "
                        "(pp) or --tp N (tp); default 4")
    g.add_argument("--parallel", choices=["pp", "tp"], default=None,
                   help="shorthand: pp = one pipeline stage per device (TD-Pipe, PP+SB, PP+HB); tp = tensor parallel "
                        "over all devices (TP+SB, TP+HB); default pp")
    g.add_argument("--model", default=None,
                   help=f"shipped config ({', '.join(model_names())}; or 13b/32b/70b), 'bundled' (SmolLM2), a folder "
                        "with config.json or a config .json file; no weights are read (default llama-2-70b; the "
                        "studies: their papers' own)")
    g.add_argument("--threads-per-device", type=int, default=None,
                   help="cpu: threads of one device (default: the cores split evenly over the devices)")
    g.add_argument("--allreduce-bw", type=float, default=None, metavar="GB/s",
                   help="override the node's all-reduce bus bandwidth (e.g. 300 for NVLink)")
    g.add_argument("--link-bw", type=float, default=None, metavar="GB/s",
                   help="override the stage-to-stage bandwidth")
    g.add_argument("--recalibrate", action="store_true", help="cpu: measure this machine again")
    g.add_argument("--prefill-devices", type=int, default=None, metavar="P",
                   help="prefill/decode disaggregation in space (DistServe; sim/pd.py): P devices prefill, "
                        "--decode-devices D decode, the KV sent between them at --link-bw per device link")
    g.add_argument("--decode-devices", type=int, default=None, metavar="D",
                   help="with --prefill-devices: the devices that decode")
    g.add_argument("--prefill-parallel", choices=["pp", "tp"], default="pp",
                   help="with --prefill-devices: the prefill instance as pipeline stages or one TP group "
                        "(default: %(default)s)")
    g.add_argument("--decode-parallel", choices=["pp", "tp"], default="pp",
                   help="with --prefill-devices: the decode instance as pipeline stages or one TP group "
                        "(default: %(default)s)")
    g = p.add_argument_group("engine")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help=f"most sequences running (default {EngineArgs.max_num_seqs} per pipeline stage: each of "
                        f"vLLM's virtual engines had its own {EngineArgs.max_num_seqs})")
    g.add_argument("--max-model-len", type=int, default=None, help="prompt + output limit (default: the model's)")
    g.add_argument("--block-size", type=int, default=EngineArgs.block_size,
                   help="tokens per KV block (default: %(default)s)")
    g.add_argument("--kv-cache-memory", type=parse_memory, default=None,
                   help="KV cache bytes in all (e.g. 2GiB); default: device memory x mem_util minus weights and "
                        "reserve (GPUs); the real engine's default budget (cpu)")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="exact number of KV blocks")
    g.add_argument("--layer-partition", type=parse_partition, default=None,
                   help="layers per stage (default: balanced by FLOPs, embedding and lm_head counted)")
    EngineArgs.add_scheduler_cli_args(g)
    g = p.add_argument_group("workload (as tdpipe bench throughput)")
    g.add_argument("--workload", choices=["sharegpt", "fixed"], default="sharegpt",
                   help="sharegpt: log-normal lengths shaped like vLLM's ShareGPT sampling; fixed: --input-len, "
                        "--output-len")
    g.add_argument("--input-len", type=int, default=None)
    g.add_argument("--output-len", type=int, default=None)
    g.add_argument("--num-prompts", type=int, default=None,
                   help="requests, all submitted at once (default 5000 as TD-Pipe; --sweep-layouts: 2000)")
    g.add_argument("--dataset", default=None, help="JSONL with prompt_token_ids and output_len per line")
    g.add_argument("--workload-seed", type=int, default=0)
    g = p.add_argument_group("output")
    g.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    g.add_argument("--trace", default=None, metavar="FILE",
                   help="write the simulated timeline (tdpipe-trace/1); draw it with `tdpipe plot timeline FILE`")
    g.add_argument("--markdown", default=None, metavar="FILE", help="--figure11/--compare: also write the table")
    g = p.add_argument_group("studies")
    g.add_argument("--figure11", action="store_true",
                   help="TD-Pipe's Figure 11 grid: L20+13B, L20+32B, A100+32B, A100+70B x 1/2/4 devices x TP+SB, "
                        "TP+HB, PP+SB (tdpipe's separate, and vLLM 0.5.3's: vllm-pp), PP+HB, TD-Pipe, and prefill/decode "
                        "disaggregation (PD), with the paper's stated ratios beside")
    g.add_argument("--sweep-layouts", type=int, default=None, metavar="N",
                   help="SiPipe Fig. 1 (§1, §7.1): every P x T = N layout (N x 1 ... 1 x N) under --policies; "
                        "defaults to its testbed: --hardware h100-nvl (8 per node), --model llama-3.1-405b, "
                        "batch 1024 (--max-num-seqs), --num-prompts 2000")
    g.add_argument("--policies", default="hybrid,td-pipe", metavar="P,Q",
                   help="--sweep-layouts: the policies of each layout (default: %(default)s)")
    g.add_argument("--figure6", action="store_true",
                   help="TD-Pipe Fig. 6 (§2.2.3): one prefill step of Llama-30B under tensor parallelism on 1 to 4 "
                        "devices of L20 and A100 nodes, time split into compute and all-reduce (--input-len tokens, "
                        "default 2048 per step); --plot draws it")
    g.add_argument("--plot", default=None, metavar="PNG", help="--sweep-layouts/--figure6: also draw it")
    g.add_argument("--jobs", type=int, default=1, help="--figure11: cells simulated in parallel processes")
    g.add_argument("--pairs", default=None, metavar="HW/MODEL,...",
                   help="--figure11: only these node-model pairs, e.g. a100-80g/llama-2-70b (default: all four)")
    g.add_argument("--compare", nargs="+", default=None, metavar="BENCH_JSON",
                   help="replay real `tdpipe bench throughput --json` runs of the bundled model on the calibrated "
                        "CPU row and print real vs simulated throughput and bubble ratio")
    p.set_defaults(fn=run)
    return p


def _scheduler_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    return EngineArgs.from_cli(a).scheduler_kwargs()


def _engine_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    """LLM-style keywords for SimConfig.engine: the scheduler's flags and the engine flags simulate has (None:
    the simulator's default)."""
    return _scheduler_kwargs(a) | {"max_num_seqs": a.max_num_seqs, "max_model_len": a.max_model_len,
                                   "block_size": a.block_size, "layer_partition": a.layer_partition}


def preflight(a: argparse.Namespace) -> None:
    """Inputs and outputs checked before anything is simulated: a --figure11 grid takes hours, and a --json
    in a missing directory used to lose all of it at the very end."""
    from tdpipe.entrypoints.preflight import check_readable, check_writable

    for path in a.compare or []:
        check_readable(path, "--compare")
    check_readable(a.dataset, "--dataset")
    check_writable(a.json, "--json")
    check_writable(a.trace, "--trace")
    check_writable(a.markdown, "--markdown")
    check_writable(getattr(a, "plot", None), "--plot")


def run(a: argparse.Namespace) -> int:
    preflight(a)
    if a.compare:
        return _compare(a)
    if a.figure11:
        return _figure11(a)
    if a.figure6 or a.sweep_layouts:
        from tdpipe.sim import layouts

        return layouts.run_study(a, _engine_kwargs(a), _NoTokenizer())
    if a.prefill_devices is not None or a.decode_devices is not None:
        return _pd(a)
    from tdpipe.bench.throughput import build_workload
    from tdpipe.config import ModelConfig, default_threads
    from tdpipe.sim.cost import check_tensor_parallel, model_bytes
    from tdpipe.sim.hardware import GB, load_hardware, with_links
    from tdpipe.sim.runner import SimConfig, sim_model_config, simulate

    a.hardware, a.model, a.num_prompts = a.hardware or "a100-80g", a.model or "llama-2-70b", a.num_prompts or 5000
    pp, tp = resolve_layout(a)
    devices = pp * tp
    threads = a.threads_per_device or max(1, default_threads() // devices)
    hw = load_hardware(a.hardware, threads=threads if a.hardware == "cpu" else None, recalibrate=a.recalibrate)
    hw = with_links(hw, a.allreduce_bw and a.allreduce_bw * GB, a.link_bw and a.link_bw * GB)
    _, hf = sim_model_config(a.model)
    check_tensor_parallel(ModelConfig.from_hf(hf), tp, a.model)
    cfg = SimConfig(hw, devices, "pp", a.model, num_kv_blocks=a.num_kv_blocks, kv_cache_memory=a.kv_cache_memory,
                    engine=_engine_kwargs(a), tensor_parallel=tp)
    max_len = min(a.max_model_len or hf.get("max_position_embeddings", 4096), hf.get("max_position_embeddings", 4096))
    name, reqs = build_workload(argparse.Namespace(**vars(a), history=None), hf["vocab_size"], max_len, _NoTokenizer())
    res = simulate(cfg, reqs, trace_path=a.trace)
    res["workload"] = {"name": name, "seed": a.workload_seed}
    res["model_weights_gb"] = model_bytes(ModelConfig.from_hf(hf)) / GB
    print(format_table(res, pp))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def resolve_layout(a: argparse.Namespace) -> tuple[int, int]:
    """(P, T) from --pp/--tp, or from the --num-devices/--parallel shorthand; a mix must agree."""
    for flag in ("pp", "tp", "num_devices"):
        v = getattr(a, flag)
        if v is not None and v < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    if a.pp is None and a.tp is None:
        n = a.num_devices or 4
        return (n, 1) if (a.parallel or "pp") == "pp" else (1, n)
    pp = a.pp or (a.num_devices // a.tp if a.num_devices and a.tp and a.num_devices % a.tp == 0 else 1)
    tp = a.tp or (a.num_devices // pp if a.num_devices and a.num_devices % pp == 0 else 1)
    if a.num_devices is not None and a.num_devices != pp * tp:
        raise ValueError(f"--num-devices {a.num_devices} is not --pp {pp} x --tp {tp} = {pp * tp}")
    if a.parallel == "pp" and tp > 1 or a.parallel == "tp" and pp > 1:
        raise ValueError(f"--parallel {a.parallel} contradicts --pp {pp} --tp {tp}; give --pp and --tp alone")
    return pp, tp


class _NoTokenizer:
    def encode(self, *_: Any, **__: Any) -> list[int]:
        raise ValueError("the simulator has no tokenizer: give the dataset as prompt_token_ids")


def format_table(r: dict[str, Any], stages: int) -> str:
    from tdpipe.core.scheduler.registry import get_policy

    hw = r["hardware"]
    rows = [
        ("deployment", f"{r['num_devices']}x {hw['name']} (pp {r['pp']} x tp {r['tp']}: {stages} stage(s) of "
                       f"{r['tp']} device(s)), model {r['model']} ({r['model_weights_gb']:.1f} GB of weights)"),
        ("policy", f"{r['policy']}, max_num_seqs {r['max_num_seqs']}, budget {r['max_num_batched_tokens']} tokens"),
        ("workload", f"{r['workload']['name']} (seed {r['workload']['seed']}): {r['num_requests']} requests, "
                     f"{r['total_input_tokens']} in / {r['total_output_tokens']} out tokens"),
        ("simulated time", f"{r['elapsed_s']:.2f} s"),
        ("output tokens/s", f"{r['output_tokens_per_s']:.1f}"),
        ("total tokens/s", f"{r['total_tokens_per_s']:.1f}"),
        ("bubble ratio", f"{r['bubble_ratio']:.3f} mean (per stage: "
                         f"{', '.join(f'{b:.3f}' for b in r['bubble_ratio_per_stage'])})"),
        *([("all-reduce", f"{sum(r['allreduce_s_per_stage']):.2f} s of {sum(r['busy_s_per_stage']):.2f} s charged "
                          f"stage time ({100 * r['allreduce_share']:.1f}%; TD-Pipe Fig. 6's communication share)")]
          if r["tp"] > 1 else []),
        ("KV cache", f"{r['kv_blocks']} blocks = {r['kv_capacity_tokens']} tokens, time-mean usage "
                     f"{100 * r['kv_usage_mean']:.1f}%"),
        ("steps", f"{r['prefill_steps']} prefill, {r['decode_steps']} decode, {r['mixed_steps']} mixed; "
                  + get_policy(r["policy"]).stats_text(r)),
        ("simulator", f"{r['sim_wall_s']:.1f} s wall on this machine"),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def _figure11(a: argparse.Namespace) -> int:
    import time

    from tdpipe.sim import grid

    t = time.perf_counter()
    kw = _scheduler_kwargs(a)
    kw.pop("scheduler")
    engine = {k: v for k, v in kw.items() if v is not None} | {"block_size": a.block_size}
    if a.max_num_seqs:
        engine["max_num_seqs"] = a.max_num_seqs
    a.num_prompts = a.num_prompts or 5000
    pairs = grid.parse_pairs(a.pairs) if a.pairs else None
    results = grid.run_grid(a.num_prompts, a.workload_seed, engine, jobs=a.jobs, pairs=pairs)
    meta = {"num_prompts": a.num_prompts, "seed": a.workload_seed, "wall_s": time.perf_counter() - t,
            "pairs": [f"{hw}/{m}" for hw, m in (pairs or grid.PAIRS)],
            "engine": {k: (list(v) if isinstance(v, tuple) else v) for k, v in engine.items()}}
    print(grid.write(results, meta, a.json, a.markdown))
    return 0


def _pd(a: argparse.Namespace) -> int:
    """One run of prefill/decode disaggregation: --prefill-devices P --decode-devices D (sim/pd.py)."""
    from tdpipe.bench.throughput import build_workload
    from tdpipe.sim.hardware import GB, load_hardware, with_links
    from tdpipe.sim.pd import PDConfig, simulate_pd
    from tdpipe.sim.runner import sim_model_config

    if a.prefill_devices is None or a.decode_devices is None:
        raise ValueError("--prefill-devices and --decode-devices go together")
    if a.hardware == "cpu" or a.num_kv_blocks is not None or a.kv_cache_memory is not None:
        raise ValueError("--prefill-devices: each side sizes its KV cache from a GPU row's memory; --hardware cpu, "
                         "--num-kv-blocks and --kv-cache-memory are not supported with it")
    a.hardware, a.model, a.num_prompts = a.hardware or "a100-80g", a.model or "llama-2-70b", a.num_prompts or 5000
    hw = with_links(load_hardware(a.hardware), a.allreduce_bw and a.allreduce_bw * GB, a.link_bw and a.link_bw * GB)
    _, hf = sim_model_config(a.model)
    max_len = min(a.max_model_len or hf.get("max_position_embeddings", 4096), hf.get("max_position_embeddings", 4096))
    name, reqs = build_workload(argparse.Namespace(**vars(a), history=None), hf["vocab_size"], max_len, _NoTokenizer())
    engine = {k: v for k, v in _engine_kwargs(a).items() if k != "scheduler"}
    cfg = PDConfig(hw, a.prefill_devices, a.decode_devices, a.model, a.prefill_parallel, a.decode_parallel,
                   engine=engine)
    res = simulate_pd(cfg, reqs)
    res["workload"] = {"name": name, "seed": a.workload_seed}
    print(format_pd_table(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def format_pd_table(r: dict[str, Any]) -> str:
    p, d = r["prefill"], r["decode"]
    rows = [
        ("deployment", f"{r['num_devices']}x {r['hardware']['name']}: {p['devices']} prefill ({p['parallel']}), "
                       f"{d['devices']} decode ({d['parallel']}), model {r['model']}"),
        ("workload", f"{r['workload']['name']} (seed {r['workload']['seed']}): {r['num_requests']} requests, "
                     f"{r['total_input_tokens']} in / {r['total_output_tokens']} out tokens"),
        ("simulated time", f"{r['elapsed_s']:.2f} s"),
        ("output tokens/s", f"{r['output_tokens_per_s']:.1f}"),
        ("total tokens/s", f"{r['total_tokens_per_s']:.1f}"),
        ("TTFT", f"mean {r['ttft_mean_s']:.2f} s, p50 {r['ttft_p50_s']:.2f} s, p99 {r['ttft_p99_s']:.2f} s "
                 "(all requests submitted at 0)"),
        ("TPOT", f"mean {1e3 * r['tpot_mean_s']:.1f} ms, p50 {1e3 * r['tpot_p50_s']:.1f} ms, "
                 f"p99 {1e3 * r['tpot_p99_s']:.1f} ms"),
        ("KV transfer", f"{r['kv_bytes_per_token'] / 1e6:.3f} MB per token, mean "
                        f"{1e3 * r['kv_transfer_mean_s']:.2f} ms per request, links busy "
                        f"{100 * r['kv_link_busy']:.1f}% of the run"),
        ("KV caches", f"prefill {p['kv_capacity_tokens']} tokens, decode {d['kv_capacity_tokens']} tokens"),
        ("idle devices", f"{r['bubble_ratio']:.3f} of all device time (bubble ratio: prefill {p['bubble_ratio']:.3f}, "
                         f"decode {d['bubble_ratio']:.3f}, each over its own span)"),
        ("preemptions", f"prefill {p['preemptions']}, decode {d['preemptions']}"),
        ("simulator", f"{r['sim_wall_s']:.1f} s wall on this machine"),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def _compare(a: argparse.Namespace) -> int:
    from tdpipe.sim import fidelity

    rows = [fidelity.replay(f) for f in a.compare]
    md = fidelity.markdown(rows)
    print(md)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(md)
    return 0


__all__ = ["add_parser", "resolve_layout", "run"]
