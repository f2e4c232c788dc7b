"""Set a simulated run beside a real one: replay a `tdpipe bench throughput --json` result in the simulator.

The simulation takes everything from the bench file (policy and its knobs, pp, layer partition, threads per
stage, the exact number of KV blocks, the workload's name, size and seed) and the calibrated CPU row
(sim/calibrate.py) for the stage's thread count, then reports both throughputs and bubble ratios.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

SCHEDULER_KEYS = ("max_num_batched_tokens", "scheduler", "throttle_T", "max_prefill_tokens", "min_prefill_tokens",
                  "kv_thresh", "future_points", "switch_to_decode", "switch_to_prefill", "work_stealing", "predictor")


def replay(bench_path: str) -> dict[str, Any]:
    from tdpipe.bench.throughput import build_workload
    from tdpipe.sim.calibrate import cpu_hardware
    from tdpipe.sim.runner import SimConfig, sim_model_config, simulate

    with open(bench_path) as f:
        real = json.load(f)
    if real.get("simulated"):
        raise ValueError(f"{bench_path} is a simulated result; --compare takes `tdpipe bench throughput --json` files")
    eng = real.get("engine") or {}
    name = real["workload"]["name"]
    if eng.get("model") not in (None, "bundled"):
        raise ValueError(f"{bench_path}: only runs of the bundled model can be replayed (the CPU calibration is "
                         f"of it), this one ran {eng.get('model')!r}")
    if name not in ("sharegpt", "fixed"):
        raise ValueError(f"{bench_path}: workload {name!r} cannot be rebuilt without the original files; "
                         "replay sharegpt or fixed workloads")
    threads = real["stage_threads"][0]
    hw = cpu_hardware(threads)
    max_len = eng["max_model_len"]
    n = real["num_requests"]
    fixed = name == "fixed"
    flags = argparse.Namespace(  # the bench's own workload builder, as the real run called it
        workload=name, num_prompts=n, workload_seed=real["workload"]["seed"], dataset=None, history=None,
        input_len=real["total_input_tokens"] // n if fixed else None,
        output_len=real["total_output_tokens"] // n if fixed else None)
    _, reqs = build_workload(flags, sim_model_config(None)[1]["vocab_size"], max_len)
    kw = {k: eng[k] for k in SCHEDULER_KEYS if k in eng}
    if "future_points" in kw:
        kw["future_points"] = tuple(kw["future_points"])
    kw |= {"max_num_seqs": eng.get("max_num_seqs", 256), "max_model_len": max_len,
           "block_size": eng.get("block_size", 16), "layer_partition": real["layer_partition"]}
    cfg = SimConfig(hw, real["pp"], "pp", None, num_kv_blocks=real["kv_blocks"], engine=kw)
    sim = simulate(cfg, reqs)
    if sim["total_input_tokens"] != real["total_input_tokens"] or sim["total_output_tokens"] != real["total_output_tokens"]:
        raise ValueError(f"{bench_path}: the rebuilt workload differs from the real one "
                         f"({sim['total_input_tokens']}/{sim['total_output_tokens']} vs "
                         f"{real['total_input_tokens']}/{real['total_output_tokens']} tokens)")
    return {"file": bench_path, "policy": real["policy"], "pp": real["pp"], "threads": threads,
            "real_output_tokens_per_s": real["output_tokens_per_s"], "sim_output_tokens_per_s": sim["output_tokens_per_s"],
            "throughput_error": sim["output_tokens_per_s"] / real["output_tokens_per_s"] - 1,
            "real_bubble_ratio": real["bubble_ratio"], "sim_bubble_ratio": sim["bubble_ratio"],
            "real_preemptions": real["preemptions"], "sim_preemptions": sim["preemptions"],
            "real_decode_steps": real["decode_steps"], "sim_decode_steps": sim["decode_steps"],
            "sim_wall_s": sim["sim_wall_s"], "machine": real.get("machine", {}).get("cpu"), "hardware": hw.to_json()}


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| policy | pp | real out tok/s | simulated | error | real bubble | simulated bubble | "
             "preemptions real / sim | decode steps real / sim |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['pp']} | {r['real_output_tokens_per_s']:.1f} | "
                     f"{r['sim_output_tokens_per_s']:.1f} | {100 * r['throughput_error']:+.1f}% | "
                     f"{r['real_bubble_ratio']:.3f} | {r['sim_bubble_ratio']:.3f} | "
                     f"{r['real_preemptions']} / {r['sim_preemptions']} | "
                     f"{r['real_decode_steps']} / {r['sim_decode_steps']} |")
    return "\n".join(lines) + "\n"


__all__ = ["markdown", "replay"]
