"""Resident weight memory of a model built as the engine's stages build it, per --quantization: the bytes of
every tensor the model holds (parameters, buffers, oneDNN's packed bf16 weights), each storage once; and
of those, the weights alone: all but the rotary position tables (float32 cos / sin per position, the same
in every mode and sized by the context length, not by the model's weights).

    .venv/bin/python scripts/quant/weight_memory.py --json bench_results/quant/weight_memory_smollm2.json
    .venv/bin/python scripts/quant/weight_memory.py --model /tmp/smollm2-awq --json bench_results/quant/weight_memory_smollm2_awq.json
"""
from __future__ import annotations

import argparse
import gc
import json

import torch

from tdpipe.config import ModelConfig
from tdpipe.model.block_linear import resident_bytes
from tdpipe.model.bundled import resolve_model
from tdpipe.model.llama import LlamaForCausalLM
from tdpipe.model.quantization import prepare_linears, resolve_quantization
from tdpipe.model.awq import awq_spec, read_checkpoint
from tdpipe.model.weights import load_hf_config


def measure(model_arg: str | None, method: str) -> dict:
    folder = resolve_model(model_arg)
    cfg = ModelConfig.from_hf(load_hf_config(folder))
    method, gguf = resolve_quantization(method, model_arg, "cpu", True)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu")
    model.load_weights(read_checkpoint(folder, names=model.wants))
    model = model.to(torch.bfloat16).eval()
    model.init_rotary("cpu")  # float32 tables, as the engine keeps them after the cast
    prepare_linears(model, method, gguf, folder)
    n = resident_bytes(model)
    tables = sum(resident_bytes(r) for r in (model.rotary, model.rotary_local) if r is not None)
    params = sum(p.numel() for p in model.parameters())
    del model
    gc.collect()
    return {"quantization": method, "resident_bytes": n, "rope_table_bytes": tables, "weight_bytes": n - tables,
            "float_params_left": params}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a .gguf file or an AWQ folder (default: the bundled SmolLM2's "
                                                  "GGUF)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rows = [measure(a.model, "none"), measure(a.model, "awq" if awq_spec(a.model) else "gguf")]
    cfg = ModelConfig.from_hf(load_hf_config(resolve_model(a.model)))
    bf16_params = cfg.num_params() * 2
    for r in rows:
        r["vs_none"] = r["resident_bytes"] / rows[0]["resident_bytes"]
        r["weights_vs_none"] = r["weight_bytes"] / rows[0]["weight_bytes"]
        r["vs_bf16_params"] = r["weight_bytes"] / bf16_params
    out = {"model": a.model or "bundled SmolLM2-135M-Instruct Q4_1 GGUF", "bf16_param_bytes": bf16_params,
           "rows": rows}
    print("| quantization | resident MiB (all tensors) | vs none | weights MiB (without rope tables) | vs none "
          "| weights vs the bf16 parameters |\n| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['quantization']} | {r['resident_bytes'] / 2**20:.1f} | {r['vs_none']:.1%} | "
              f"{r['weight_bytes'] / 2**20:.1f} | {r['weights_vs_none']:.1%} | {r['vs_bf16_params']:.1%} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
