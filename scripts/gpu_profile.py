"""Where a decode step's time goes on a GPU: the engine (pp = 1, bf16) on 256 x (128 in / 128 out) under
torch.profiler, for the bundled model and for Llama-3-8B's layer shapes cut to 4 layers (random weights).
Writes the top ops by self CUDA time and by self CPU time, and the step counts, to OUT (default: .).

    PYTHONPATH=src python3 scripts/gpu_profile.py [OUT]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from tdpipe import LLM, SamplingParams
from tdpipe.bench import workload as wl
from tdpipe.bench.gpu_check import model_config, model_folder
from tdpipe.model.random_model import random_model_folder


def run(path: str, out: Path, name: str) -> dict:
    cfg = json.loads((Path(path) / "config.json").read_text())
    reqs = wl.fixed(256, 128, 128, cfg["vocab_size"], seed=0)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    sp = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    with LLM(path, dtype="bfloat16", device="cuda", max_num_seqs=256) as llm:
        llm.generate(prompts[:8], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        t = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        plain = time.perf_counter() - t
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            profiled = time.perf_counter() - t
    ka = prof.key_averages()
    (out / f"{name}_cuda.txt").write_text(ka.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70))
    (out / f"{name}_cpu.txt").write_text(ka.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))
    cuda_total = sum(e.self_device_time_total for e in ka) / 1e6
    res = {"model": name, "elapsed_s": plain, "profiled_elapsed_s": profiled, "gpu_busy_s": cuda_total,
           "output_tok_s": 256 * 128 / plain}
    print(res, flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?", default=".", help="folder for the profiles and profile.json")
    out = Path(p.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    res = [run(model_folder("bundled", "cuda")[0], out, "bundled")]
    cfg = {k: v for k, v in model_config("llama-3-8b").items() if not k.startswith("_")} | {"num_hidden_layers": 4}
    res.append(run(random_model_folder(cfg, device="cuda"), out, "llama8b_4layers"))
    (out / "profile.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
