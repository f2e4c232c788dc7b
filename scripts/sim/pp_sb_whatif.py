"""What the PP+SB gap depends on (docs/simulator.md, "Figure 11 against the PP+SB the paper ran"): TD-Pipe
against vLLM 0.5.3's PP+SB (`vllm-pp`) on 4 x A100-80G + Llama-2-70B, 2000 ShareGPT-like requests, with one
thing changed at a time: vLLM 0.5.3's own token budget, the other slot binding, longer answers, and a larger
engine cost per micro-batch. What-ifs, not fits: none of them is the simulator's default.

Usage: python scripts/sim/pp_sb_whatif.py bench_results/sim/pp_sb_whatif_70b.json
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace

from tdpipe.bench import workload as wl
from tdpipe.sim.hardware import load_hardware
from tdpipe.sim.runner import SimConfig, sim_model_config, simulate

MODEL, HW, N = "llama-2-70b", "a100-80g", 2000
# (name, scheduler, engine keywords, hardware fields, sharegpt_like keywords)
CASES = [
    ("defaults", "vllm-pp", {}, {}, {}),
    ("defaults", "td-pipe", {}, {}, {}),
    ("vLLM 0.5.3's budget, max(max_model_len, 2048) = 4096", "vllm-pp", {"max_num_batched_tokens": 4096}, {}, {}),
    ("--slot-binding most-free-kv", "vllm-pp", {"slot_binding": "most-free-kv"}, {}, {}),
    ("longer answers (output median 215: mean 313)", "vllm-pp", {}, {}, {"output_median": 215}),
    ("longer answers (output median 215: mean 313)", "td-pipe", {}, {}, {"output_median": 215}),
    ("engine 10 ms per micro-batch", "vllm-pp", {}, {"engine_step": 0.010}, {}),
    ("engine 25 ms per micro-batch", "vllm-pp", {}, {"engine_step": 0.025}, {}),
]


def main(path: str) -> None:
    vocab = sim_model_config(MODEL)[1]["vocab_size"]
    rows = []
    for name, sched, engine, hw_fields, work in CASES:
        reqs = wl.sharegpt_like(N, vocab, 0, 2048, **work)
        hw = replace(load_hardware(HW), **hw_fields)
        r = simulate(SimConfig(hw, 4, "pp", MODEL, engine={"scheduler": sched, **engine}), reqs)
        row = {"case": name, "scheduler": sched, "engine": engine, "hardware_fields": hw_fields, "workload": work,
               "mean_output": r["total_output_tokens"] / N,
               **{k: r[k] for k in ("output_tokens_per_s", "bubble_ratio", "preemptions", "kv_usage_mean")}}
        rows.append(row)
        print(f"{sched:8} {name}: {row['output_tokens_per_s']:.0f} out tok/s, bubble {row['bubble_ratio']:.3f}",
              flush=True)
    with open(path, "w") as f:
        json.dump({"hardware": HW, "model": MODEL, "num_prompts": N, "seed": 0, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", help="where the rows go (JSON)")
    main(p.parse_args().json)
