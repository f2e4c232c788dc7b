"""P x T studies on the simulator: SiPipe's Figure 1 sweep and TD-Pipe's Figure 6 breakdown.

- `sweep`: every P x T = N layout (SiPipe §1 writes it P_t^p: p stages of t tensor-parallel GPUs) under a few
  policies, one workload, throughput per layout. SiPipe's testbed (§7.1): 16 H100 in two nodes of 8 (NVLink
  inside, 400 Gbps NICs between), batch 1024, ShareGPT prompts.
- `figure6`: TD-Pipe §2.2.3 times one prefill of Llama-30B under tensor parallelism on 1-4 GPUs of its L20 and
  A100 nodes (PCIe switch, no NVLink) and splits the time into computation and all-reduce. Here the same split
  comes from the cost model's charged times (cost.CostModel.layer_time / allreduce_time) per layer.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Any

# TD-Pipe §2.2.3, Figure 6 (text): 1 -> 4 devices cuts the prefill time by these factors, and all-reduce is
# this share of the 4-device time
FIG6_PAPER = {"l20": {"speedup_4": 1.84, "comm_share_4": 0.4739}, "a100-80g": {"speedup_4": 1.64, "comm_share_4": 0.539}}
# SiPipe §1 / §7.2, Figure 1 (text): 16 H100, best PP configurations against pure TP
FIG1_PAPER = ("vLLM peaks at p = 2 or 4; on DeepSeek V3 vLLM P(4,4) is 3.22x pure TP P(1,16), SiPipe up to 4.5x "
              "pure TP (Figure 1 gives no per-layout numbers in the text)")


def layouts_of(n: int) -> list[tuple[int, int]]:
    """(P, T) with P x T = n, pure pipeline first."""
    if n < 1:
        raise ValueError(f"--sweep-layouts needs a device count >= 1, got {n}")
    return [(n // t, t) for t in range(1, n + 1) if n % t == 0]


def sweep(n: int, hardware: str, model: str, policies: list[str], reqs: list, engine: dict[str, Any]) -> list[dict]:
    """One simulated run per layout and policy; a layout the model cannot take is a row with `error`."""
    from tdpipe.config import ModelConfig
    from tdpipe.sim.cost import check_tensor_parallel
    from tdpipe.sim.hardware import load_hardware
    from tdpipe.sim.runner import DoesNotFit, SimConfig, sim_model_config, simulate

    hw = load_hardware(hardware)
    mc = ModelConfig.from_hf(sim_model_config(model)[1])
    rows = []
    for p, t in layouts_of(n):
        for policy in policies:
            row: dict[str, Any] = {"layout": f"{p}x{t}", "pp": p, "tp": t, "policy": policy}
            try:
                check_tensor_parallel(mc, t, model)
                res = simulate(SimConfig(hw, n, "pp", model, engine=engine | {"scheduler": policy},
                                         tensor_parallel=t), reqs)
            except (DoesNotFit, ValueError) as e:
                row["error"] = str(e)
            else:
                row |= {k: res[k] for k in ("output_tokens_per_s", "total_tokens_per_s", "elapsed_s", "bubble_ratio",
                                            "allreduce_share", "kv_blocks", "layer_partition", "preemptions")
                        if k in res}
            rows.append(row)
            print(f"  {row['layout']:>6} {policy:<9} " + (f"n/a: {row['error'][:100]}" if "error" in row else
                  f"{row['output_tokens_per_s']:10.0f} out tok/s, bubble {row['bubble_ratio']:.3f}, all-reduce "
                  f"{100 * row['allreduce_share']:.1f}% of stage time"), flush=True)
    best_tp = {pol: next((r["output_tokens_per_s"] for r in rows if r["policy"] == pol and r["pp"] == 1
                          and "error" not in r), None) for pol in policies}
    for r in rows:
        ref = best_tp[r["policy"]]
        r["vs_pure_tp"] = r["output_tokens_per_s"] / ref if ref and "error" not in r else None
    return rows


def figure6(hardware: list[str], model: str, tokens: int, prompts: int, tps: list[int]) -> list[dict]:
    """Per-layer charged time of one prefill step (`prompts` prompts, `tokens` tokens in all) under tensor
    parallelism: compute (linears, attention, overhead) and the two all-reduces."""
    from tdpipe.config import ModelConfig
    from tdpipe.sim.cost import CostModel, StepShape, check_tensor_parallel
    from tdpipe.sim.hardware import load_hardware
    from tdpipe.sim.runner import sim_model_config

    mc = ModelConfig.from_hf(sim_model_config(model)[1])
    each = tokens // prompts
    shape = StepShape.of([each] * prompts, [each] * prompts)
    rows = []
    for name in hardware:
        hw = load_hardware(name)
        base = None
        for t in tps:
            row: dict[str, Any] = {"hardware": hw.name, "tp": t}
            try:
                check_tensor_parallel(mc, t, model)
            except ValueError as e:
                row["error"] = str(e)
                rows.append(row)
                continue
            cm = CostModel(mc, hw, [(0, mc.num_layers)], t)
            total = cm.layer_time(shape) * mc.num_layers
            ar = cm.allreduce_time(shape) * mc.num_layers
            base = base or total
            row |= {"total_ms": 1e3 * total, "compute_ms": 1e3 * (total - ar), "allreduce_ms": 1e3 * ar,
                    "comm_share": ar / total, "speedup_vs_1": base / total}
            paper = FIG6_PAPER.get(hw.name, {})
            if t == 4 and paper:
                row["paper_speedup"], row["paper_comm_share"] = paper["speedup_4"], paper["comm_share_4"]
            rows.append(row)
    return rows


def sweep_markdown(rows: list[dict], meta: dict[str, Any]) -> str:
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    out = [f"SiPipe Figure 1 kind of sweep: {meta['devices']}x {meta['hardware']}, {meta['model']}, "
           f"{meta['num_prompts']} ShareGPT-like requests (seed {meta['seed']}), batch {meta['max_num_seqs']}; "
           "output tokens/s (ratio to pure TP 1 x N of the same policy; n/a: the layout cannot hold the model)", "",
           "| layout P x T | " + " | ".join(policies) + " | all-reduce share of stage time |",
           "| --- | " + " | ".join("---" for _ in policies) + " | --- |"]
    for layout in dict.fromkeys(r["layout"] for r in rows):
        cells, share = [], "-"
        for pol in policies:
            r = next(x for x in rows if x["layout"] == layout and x["policy"] == pol)
            if "error" in r:
                cells.append("n/a")
                continue
            ratio = f" ({r['vs_pure_tp']:.2f}x)" if r.get("vs_pure_tp") else ""
            cells.append(f"{r['output_tokens_per_s']:.0f}{ratio}")
            share = f"{100 * r['allreduce_share']:.1f}%"
        out.append(f"| {layout} | " + " | ".join(cells) + f" | {share} |")
    errors = {r["layout"]: r["error"] for r in rows if "error" in r}
    out += [""] + [f"- {k}: {v}" for k, v in errors.items()]
    out += ["", f"Paper: {FIG1_PAPER}."]
    return "\n".join(out) + "\n"


def figure6_markdown(rows: list[dict], meta: dict[str, Any]) -> str:
    out = [f"TD-Pipe Figure 6 kind of breakdown: one prefill step of {meta['model']} ({meta['tokens']} tokens in "
           f"{meta['prompts']} prompts), all {meta['layers']} layers, tensor parallel on one node", "",
           "| node | tp | compute ms | all-reduce ms | total ms | all-reduce share | speedup vs tp 1 | paper (tp 4) |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['hardware']} | {r['tp']} | n/a | | | | | {r['error'][:80]} |")
            continue
        paper = (f"{r['paper_speedup']:.2f}x, {100 * r['paper_comm_share']:.1f}%" if "paper_speedup" in r else "")
        out.append(f"| {r['hardware']} | {r['tp']} | {r['compute_ms']:.1f} | {r['allreduce_ms']:.1f} | "
                   f"{r['total_ms']:.1f} | {100 * r['comm_share']:.1f}% | {r['speedup_vs_1']:.2f}x | {paper} |")
    return "\n".join(out) + "\n"


def plot_sweep(rows: list[dict], meta: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    w = 0.8 / len(policies)
    for k, pol in enumerate(policies):
        ys = [next((r.get("output_tokens_per_s") or 0) for r in rows if r["layout"] == lay and r["policy"] == pol)
              for lay in layouts]
        ax.bar([i + k * w for i in range(len(layouts))], ys, w, label=pol)
    ax.set_xticks([i + w * (len(policies) - 1) / 2 for i in range(len(layouts))], layouts)
    ax.set_xlabel("layout P x T (pipeline stages x tensor-parallel devices)")
    ax.set_ylabel("output tokens/s (simulated)")
    ax.set_title(f"{meta['devices']}x {meta['hardware']}, {meta['model']} (SiPipe Fig. 1 setting)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_figure6(rows: list[dict], meta: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nodes = list(dict.fromkeys(r["hardware"] for r in rows))
    fig, axes = plt.subplots(1, len(nodes), figsize=(3.4 * len(nodes), 3.2), squeeze=False)
    for ax, node in zip(axes[0], nodes):
        ok = [r for r in rows if r["hardware"] == node and "error" not in r]
        xs = [str(r["tp"]) for r in ok]
        ax.bar(xs, [r["compute_ms"] for r in ok], label="compute")
        ax.bar(xs, [r["allreduce_ms"] for r in ok], bottom=[r["compute_ms"] for r in ok], label="all-reduce")
        ax.set_title(f"{node}: {meta['model']} prefill", fontsize=9)
        ax.set_xlabel("tensor-parallel devices")
        ax.set_ylabel("ms per prefill step (simulated)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_study(a: argparse.Namespace, engine_kwargs: dict[str, Any], tokenizer: Any) -> int:
    """`tdpipe simulate --sweep-layouts N` or `--figure6`: table, --json, --markdown, --plot. The command
    (sim/cli.py) hands over the engine keywords its flags give and the stand-in tokenizer of its workloads."""
    t0 = time.perf_counter()
    if a.figure6:
        model = a.model or "llama-30b"  # the paper's own setting
        hardware = [a.hardware] if a.hardware else ["l20", "a100-80g"]
        tokens = a.input_len or 2048
        prompts = max(1, tokens // 1024)
        rows = figure6(hardware, model, tokens, prompts, [1, 2, 3, 4])
        from tdpipe.config import ModelConfig
        from tdpipe.sim.runner import sim_model_config

        meta = {"study": "figure6", "model": model, "tokens": tokens, "prompts": prompts,
                "layers": ModelConfig.from_hf(sim_model_config(model)[1]).num_layers, "paper": FIG6_PAPER}
        md, plot = figure6_markdown(rows, meta), plot_figure6
    else:
        from tdpipe.bench.throughput import build_workload
        from tdpipe.sim.runner import sim_model_config

        model = a.model or "llama-3.1-405b"
        hardware = a.hardware or "h100-nvl"
        n_prompts = a.num_prompts or 2000
        engine = {k: v for k, v in engine_kwargs.items() if v is not None}
        engine["max_num_seqs"] = a.max_num_seqs or 1024
        _, hf = sim_model_config(model)
        max_len = min(a.max_model_len or 4096, hf.get("max_position_embeddings", 4096))
        ns = argparse.Namespace(**(vars(a) | {"num_prompts": n_prompts, "history": None}))
        name, reqs = build_workload(ns, hf["vocab_size"], max_len, tokenizer)
        policies = [p.strip() for p in a.policies.split(",") if p.strip()]
        rows = sweep(a.sweep_layouts, hardware, model, policies, reqs, engine)
        meta = {"study": "sweep-layouts", "devices": a.sweep_layouts, "hardware": hardware, "model": model,
                "num_prompts": n_prompts, "seed": a.workload_seed, "workload": name,
                "max_num_seqs": engine["max_num_seqs"], "paper": FIG1_PAPER}
        md, plot = sweep_markdown(rows, meta), plot_sweep
    meta["wall_s"] = time.perf_counter() - t0
    print(md)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(md)
    if a.plot:
        plot(rows, meta, a.plot)
    return 0


__all__ = ["figure6", "layouts_of", "run_study", "sweep"]
