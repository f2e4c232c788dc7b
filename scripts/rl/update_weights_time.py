"""How long `LLM.update_weights` takes on the bundled model (SmolLM2-135M, bf16) at pp = 1 and pp = 2: from a
checkpoint folder (each stage reads its own slices) and, at pp = 1, from tensors already in memory (what a
trainer in the same process hands over). Best and median of `--repeats`; the engine's greedy tokens are
checked unchanged after each update (same weights back).

    .venv/bin/python scripts/rl/update_weights_time.py --json bench_results/rl/update_weights.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from safetensors.torch import load_file

from tdpipe import LLM, SamplingParams
from tdpipe.bench.machine import machine_info
from tdpipe.model.bundled import bundled_model_path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    folder = bundled_model_path()
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(20, 60))}]
    rows = []
    for pp, source in ((1, "folder"), (1, "memory"), (2, "folder")):
        with LLM(folder, pipeline_parallel_size=pp, kv_cache_memory=256 << 20) as llm:
            before = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids
            times = []
            for _ in range(a.repeats):
                weights = folder if source == "folder" else [
                    kv for f in sorted(Path(folder).glob("*.safetensors")) for kv in load_file(f).items()]
                t0 = time.perf_counter()
                llm.update_weights(weights)
                times.append(time.perf_counter() - t0)
                assert llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids == before
        rows.append({"pp": pp, "source": source, "best_s": min(times), "median_s": statistics.median(times),
                     "repeats": a.repeats})
        print(f"pp = {pp}, from {source}: best {min(times):.3f} s, median {statistics.median(times):.3f} s",
              flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": "bundled SmolLM2-135M-Instruct (bf16)", "rows": rows, "machine": machine_info()},
                      f, indent=1)


if __name__ == "__main__":
    main()
