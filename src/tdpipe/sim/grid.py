"""TD-Pipe's Figure 11 grid in simulation: four node-model pairs, 1/2/4 devices, five methods (§4.1-4.2).

Methods map onto tdpipe's policies: TP+SB = tensor parallel + `separate`, TP+HB = tensor parallel +
`hybrid` (chunked prefill), PP+SB = pipeline + `separate`, PP+HB = pipeline + `hybrid`, TD-Pipe = pipeline +
`td-pipe`. PP+SB (vLLM 0.5.3) is the PP+SB the paper ran (§4.1): `vllm-pp`, each request bound for life to one
micro-batch slot with its own share of the KV cache; tdpipe's PP+SB (`separate`) re-splits the running
requests evenly at every step. Two PD rows put spatial prefill/decode disaggregation beside them (sim/pd.py):
half the devices prefill and half decode, or one device prefills and the rest decode. A further row, TD-Pipe
with the decode-to-prefill switch of its own ablation (finish-ratio 0.5, §4.4.3) instead of the intensity
comparison, shows what Approach 3 costs at this scale; another, `reachable-intensity`, keeps Eq. 1-2 but takes Peak at the decode batch a switch can reach. The paper prints the grid as bars only; its text states the ratios in PAPER_CLAIMS, which the
table sets beside the simulated ones.
"""
from __future__ import annotations

import json
from typing import Any

METHODS: dict[str, tuple[str, dict[str, Any]]] = {  # name -> (parallel, scheduler kwargs)
    "TP+SB": ("tp", {"scheduler": "separate"}), "TP+HB": ("tp", {"scheduler": "hybrid"}),
    "PP+SB": ("pp", {"scheduler": "separate"}),
    # the paper's own PP+SB: vLLM 0.5.3's virtual engines (core/scheduler/vllm_pp.py)
    "PP+SB (vLLM 0.5.3)": ("pp", {"scheduler": "vllm-pp"}),
    "PP+HB": ("pp", {"scheduler": "hybrid"}),
    "TD-Pipe": ("pp", {"scheduler": "td-pipe"}),
    # not in the paper's figure: TD-Pipe with Approach 3 replaced by its §4.4.3 ablation rule
    "TD-Pipe (finish-ratio 0.5)": ("pp", {"scheduler": "td-pipe", "switch_to_prefill": "finish-ratio:0.5"}),
    # ... and with Eq. 1's Peak taken at the batch a switch can reach (the thrash fix, docs/simulator.md)
    "TD-Pipe (reachable intensity)": ("pp", {"scheduler": "td-pipe", "switch_to_prefill": "reachable-intensity"}),
    # not in the paper: prefill/decode disaggregation in space (DistServe), each side a pipeline (sim/pd.py)
    "PD (half prefill)": ("pd", {"prefill_devices": "half"}),
    "PD (1 prefill device)": ("pd", {"prefill_devices": 1}),
}
PAIRS = [("l20", "llama-2-13b"), ("l20", "qwen2.5-32b"), ("a100-80g", "qwen2.5-32b"), ("a100-80g", "llama-2-70b")]
DEVICES = (1, 2, 4)

# TD-Pipe §4.2, stated in the text (Figure 11 itself has no printed numbers)
PAPER_CLAIMS = [
    ("TD-Pipe / TP+SB at 4 devices, best pair", "max_vs:TP+SB", 1.91),
    ("TD-Pipe / TP+HB at 4 devices, best pair", "max_vs:TP+HB", 1.90),
    ("TD-Pipe / PP+SB at 4 devices, best pair", "max_vs:PP+SB", 2.73),
    ("TD-Pipe / PP+SB (vLLM 0.5.3) at 4 devices, best pair", "max_vs:PP+SB (vLLM 0.5.3)", 2.73),
    ("TD-Pipe / PP+HB at 4 devices, best pair", "max_vs:PP+HB", 2.21),
    ("TD-Pipe / TP+SB, L20 + 32B, 4 devices", "pair_vs:l20/qwen2.5-32b:TP+SB", 1.37),
    ("TD-Pipe / TP+SB, A100 + 32B, 4 devices", "pair_vs:a100-80g/qwen2.5-32b:TP+SB", 1.90),
    ("TD-Pipe 4 devices / 2 devices, L20 + 32B", "scale:l20/qwen2.5-32b", 2.97),
    # the paper states its PP+SB and TP+SB ratios for the best pair only; these are A100 + 70B's
    ("TD-Pipe / PP+SB (vLLM 0.5.3), A100 + 70B, 4 devices (paper: best pair)",
     "pair_vs:a100-80g/llama-2-70b:PP+SB (vLLM 0.5.3)", 2.73),
    ("TD-Pipe / PP+SB, A100 + 70B, 4 devices (paper: best pair)", "pair_vs:a100-80g/llama-2-70b:PP+SB", 2.73),
    ("TD-Pipe / TP+SB, A100 + 70B, 4 devices (paper: best pair)", "pair_vs:a100-80g/llama-2-70b:TP+SB", 1.91),
]


def cells(pairs: list[tuple[str, str]] | None = None) -> list[dict[str, Any]]:
    return [{"hardware": hw, "model": m, "devices": n, "method": name}
            for hw, m in (pairs or PAIRS) for n in DEVICES for name in METHODS]


def parse_pairs(text: str) -> list[tuple[str, str]]:
    """'a100-80g/llama-2-70b,l20/llama-2-13b' -> the grid's pairs, each checked against PAIRS."""
    out = []
    for item in text.split(","):
        hw, _, m = item.strip().partition("/")
        if (hw, m) not in PAIRS:
            raise ValueError(f"--pairs item {item!r}: expected one of {', '.join(f'{a}/{b}' for a, b in PAIRS)}")
        out.append((hw, m))
    return out


def run_cell(cell: dict[str, Any], num_prompts: int, seed: int, engine: dict[str, Any]) -> dict[str, Any]:
    from tdpipe.sim.hardware import load_hardware
    from tdpipe.sim.runner import DoesNotFit, SimConfig, simulate

    from tdpipe.config import ModelConfig
    from tdpipe.core.scheduler.registry import get_policy
    from tdpipe.sim.cost import check_tensor_parallel
    from tdpipe.sim.runner import sim_model_config

    parallel, policy = METHODS[cell["method"]]
    if parallel == "pd":
        return _run_pd_cell(cell, policy, num_prompts, seed, engine)
    cfg = SimConfig(load_hardware(cell["hardware"]), cell["devices"], parallel, cell["model"],
                    engine=dict(engine) | policy)
    out = dict(cell)
    try:  # a tp that cannot split the model is a cell that cannot exist, not a throughput to print
        check_tensor_parallel(ModelConfig.from_hf(sim_model_config(cell["model"])[1]), cfg.tp, cell["model"])
    except ValueError as e:
        return out | {"invalid": str(e)}
    try:
        res = simulate(cfg, _requests(cell, num_prompts, seed))
    except DoesNotFit as e:
        return out | {"oom": str(e)}
    keep = ("output_tokens_per_s", "total_tokens_per_s", "elapsed_s", "bubble_ratio", "decode_bubble_ratio",
            *get_policy(res["policy"]).stat_names,  # preemptions, and the policy's own (td-pipe: phase_switches)
            "kv_capacity_tokens", "kv_usage_mean", "sim_wall_s")
    return out | {k: res[k] for k in keep}


def _requests(cell: dict[str, Any], num_prompts: int, seed: int) -> list:
    """Every cell's workload: the same ShareGPT-like requests (up to 2048 tokens) for the cell's model."""
    from tdpipe.bench import workload as wl
    from tdpipe.sim.runner import sim_model_config

    return wl.sharegpt_like(num_prompts, sim_model_config(cell["model"])[1]["vocab_size"], seed, 2048)


def _run_pd_cell(cell: dict[str, Any], split: dict[str, Any], num_prompts: int, seed: int,
                 engine: dict[str, Any]) -> dict[str, Any]:
    from tdpipe.sim.hardware import load_hardware
    from tdpipe.sim.pd import PDConfig, simulate_pd
    from tdpipe.sim.runner import DoesNotFit

    n = cell["devices"]
    out = dict(cell)
    if n < 2:
        return out | {"invalid": "PD needs two devices at least"}
    p = n // 2 if split["prefill_devices"] == "half" else split["prefill_devices"]
    cfg = PDConfig(load_hardware(cell["hardware"]), p, n - p, cell["model"], engine=dict(engine))
    try:
        res = simulate_pd(cfg, _requests(cell, num_prompts, seed))
    except DoesNotFit as e:
        return out | {"oom": str(e)}
    keep = ("output_tokens_per_s", "total_tokens_per_s", "elapsed_s", "bubble_ratio", "parallel", "ttft_mean_s",
            "tpot_mean_s", "kv_transfer_mean_s", "kv_link_busy", "decode_start_mean_s", "sim_wall_s")
    return out | {k: res[k] for k in keep} | {
        "preemptions": res["prefill"]["preemptions"] + res["decode"]["preemptions"],
        "kv_capacity_tokens": [res["prefill"]["kv_capacity_tokens"], res["decode"]["kv_capacity_tokens"]]}


def run_grid(num_prompts: int = 5000, seed: int = 0, engine: dict[str, Any] | None = None,
             jobs: int = 1, progress: bool = True, pairs: list[tuple[str, str]] | None = None) -> list[dict[str, Any]]:
    import sys

    todo = cells(pairs)
    args = [(c, num_prompts, seed, engine or {}) for c in todo]
    results = []
    if jobs > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(jobs) as pool:
            for r in pool.imap(_star, args):
                results.append(r)
                if progress:
                    print(_line(r), file=sys.stderr, flush=True)
    else:
        for a in args:
            results.append(run_cell(*a))
            if progress:
                print(_line(results[-1]), file=sys.stderr, flush=True)
    return results


def _star(a: tuple) -> dict[str, Any]:
    return run_cell(*a)


def _line(r: dict[str, Any]) -> str:
    what = ("OOM" if "oom" in r else "invalid: " + r["invalid"] if "invalid" in r
            else f"{r['output_tokens_per_s']:.0f} out tok/s, bubble {r['bubble_ratio']:.3f}")
    return f"{r['hardware']} {r['model']} x{r['devices']} {r['method']}: {what}"


def _tput(results: list[dict[str, Any]], hw: str, model: str, n: int, method: str) -> float | None:
    for r in results:
        if (r["hardware"], r["model"], r["devices"], r["method"]) == (hw, model, n, method):
            return r.get("output_tokens_per_s")
    return None


def claims(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The paper's stated ratios beside the simulated ones."""
    out = []
    for text, key, paper in PAPER_CLAIMS:
        kind, _, arg = key.partition(":")
        sim, where = None, ""
        if kind == "max_vs":
            best = None
            for hw, m in PAIRS:
                td, base = _tput(results, hw, m, 4, "TD-Pipe"), _tput(results, hw, m, 4, arg)
                if td and base and (best is None or td / base > best[0]):
                    best = (td / base, f"{hw} + {m}")
            if best:
                sim, where = best
        elif kind == "pair_vs":
            pair, method = arg.rsplit(":", 1)
            hw, m = pair.split("/")
            td, base = _tput(results, hw, m, 4, "TD-Pipe"), _tput(results, hw, m, 4, method)
            sim = td / base if td and base else None
        elif kind == "scale":
            hw, m = arg.split("/")
            a, b = _tput(results, hw, m, 4, "TD-Pipe"), _tput(results, hw, m, 2, "TD-Pipe")
            sim = a / b if a and b else None
        out.append({"claim": text, "paper": paper, "simulated": sim, "where": where})
    return out


def markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"Simulated output tokens/s, {meta['num_prompts']} ShareGPT-like requests (seed {meta['seed']}); "
             "OOM: the weights leave no KV cache (PD: on either side); n/a: tp cannot split the model, or PD on one "
             "device; bubble: for PD, the idle share of all devices over the run.", ""]
    for hw, m in PAIRS:
        if not any((x["hardware"], x["model"]) == (hw, m) for x in results):
            continue  # not run (--pairs)
        lines += [f"**{hw} + {m}**", "", "| method | " + " | ".join(f"{n} dev" for n in DEVICES) + " | bubble (4 dev) |",
                  "| --- | " + " | ".join("---:" for _ in DEVICES) + " | ---: |"]
        for name in METHODS:
            row = []
            b4 = "-"
            for n in DEVICES:
                r = next((x for x in results
                          if (x["hardware"], x["model"], x["devices"], x["method"]) == (hw, m, n, name)), None)
                if r is None:  # a result written before the row existed
                    row.append("-")
                    continue
                row.append("OOM" if "oom" in r else "n/a" if "invalid" in r else f"{r['output_tokens_per_s']:.0f}")
                if n == 4 and "output_tokens_per_s" in r:
                    b4 = f"{r['bubble_ratio']:.2f}"
            lines.append(f"| {name} | " + " | ".join(row) + f" | {b4} |")
        lines.append("")
    lines += ["| claim (TD-Pipe §4.2) | paper | simulated |", "| --- | ---: | ---: |"]
    for c in claims(results):
        sim = "-" if c["simulated"] is None else f"{c['simulated']:.2f}x" + (f" ({c['where']})" if c["where"] else "")
        lines.append(f"| {c['claim']} | {c['paper']:.2f}x | {sim} |")
    return "\n".join(lines) + "\n"


def write(results: list[dict[str, Any]], meta: dict[str, Any], json_path: str | None, md_path: str | None) -> str:
    md = markdown(results, meta)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"meta": meta, "cells": results, "claims": claims(results)}, f, indent=1)
    if md_path:
        with open(md_path, "w") as f:
            f.write(md)
    return md


__all__ = ["DEVICES", "METHODS", "PAIRS", "PAPER_CLAIMS", "cells", "claims", "markdown", "parse_pairs", "run_cell",
           "run_grid"]
