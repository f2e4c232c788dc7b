"""Where W8A8's perplexity cost comes from: a model's perplexity (bench/perplexity.py, same text) with every
linear int8 but one kind left in bf16, one kind at a time, and with the lm_head in bf16, as 8-bit blocks
(the engine's), int8 per call (Int8Head) or per token (Int8Linear), and with down_proj's outlier input
channels taken out of its int8 GEMM and multiplied in float (LLM.int8()'s decomposition, Dettmers et al.,
2022: the channels whose largest |x| in the batch passes 6, or the 32 largest). Each variant in a fresh
process (it patches model/quantization.py).

    .venv/bin/python scripts/quant/ppl_ablation.py --json bench_results/quant/ppl_ablation.json
    .venv/bin/python scripts/quant/ppl_ablation.py --model SMOOTHED_FOLDER --max-tokens 8192
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

VARIANTS = {  # name -> (quantization, linears kept in bf16 besides the lm_head, how the head runs,
    #                    down_proj's outlier channels: "" none, "thr:T" |x| > T, "top:K" the K largest)
    "bf16": ("none", [], "bf16", ""),
    "w8a8 (the engine's: head 8-bit blocks)": ("w8a8", [], "block", ""),
    "w8a8, head bf16": ("w8a8", [], "bf16", ""),
    "w8a8 + head int8 per call (Int8Head)": ("w8a8", [], "per-call", ""),
    "w8a8 + head int8 per token (Int8Linear)": ("w8a8", [], "per-token", ""),
    "w8a8 but qkv_proj bf16": ("w8a8", ["qkv_proj"], "block", ""),
    "w8a8 but o_proj bf16": ("w8a8", ["o_proj"], "block", ""),
    "w8a8 but gate_up_proj bf16": ("w8a8", ["gate_up_proj"], "block", ""),
    "w8a8 but down_proj bf16": ("w8a8", ["down_proj"], "block", ""),
    "w8a8, down_proj's inputs past |x| = 6 in float": ("w8a8", [], "block", "thr:6"),
    "w8a8, down_proj's 32 largest inputs in float": ("w8a8", [], "block", "top:32"),
}

CHILD = r'''
import functools, json, sys
import torch
import tdpipe.model.int8_linear as il
import tdpipe.model.quantization as Q
from tdpipe.bench.perplexity import DEFAULT_DATASET, run  # `tdpipe bench perplexity`'s own loop
q, keep, head, max_tokens = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
model_arg, outliers = sys.argv[5] or None, sys.argv[6]
orig = il.quantize_linears
def prepare(model, method, gguf_file="", folder=""):  # Q.prepare_linears with the variant's choices
    n = orig(model, skip=("lm_head", *keep)) if method == "w8a8" else 0
    if method == "w8a8":
        Q.fuse_swiglu(model)  # the engine's one-pass SwiGLU middle, or split_down below
    if method == "w8a8" and head == "block":
        Q.block_head(model)
    elif method == "w8a8" and head != "bf16":
        model.lm_head = (il.Int8Head if head == "per-call" else il.Int8Linear)(model.lm_head)
    Q.pack_linears(model)
    return n
Q.prepare_linears = prepare
def split_down(down, h):
    """down(h) with h's outlier columns (the batch's largest |x| per channel) multiplied in float against the
    dequantised int8 weight, the rest through the int8 GEMM."""
    h2 = h.reshape(-1, down.in_features).contiguous()
    colmax = h2.abs().amax(0).float()
    kind, val = outliers.split(":")
    idx = (colmax > float(val)).nonzero().flatten() if kind == "thr" else torch.topk(colmax, int(val)).indices
    rest = h2.clone()
    rest[:, idx] = 0
    q, sx = il.quantize_rows(rest)
    y = il.dequant_rows(down.int_mm(q), sx, down.weight_scale, down.bias, torch.float32)
    y = y + h2[:, idx].float() @ (down.qweight_t[idx].float() * down.weight_scale[None, :])
    return y.to(h.dtype).view(*h.shape[:-1], down.out_features)
def fuse_split(model):
    n = 0
    for m in model.modules():
        if isinstance(getattr(m, "down_proj", None), il.Int8Linear):
            m.fused = functools.partial(lambda gu, d, act, x: split_down(d, act(gu(x))), m.gate_up_proj,
                                        m.down_proj, m.act)
            n += 1
    return n
if outliers:
    Q.fuse_swiglu = fuse_split
import tdpipe.worker.model_runner as mr
mr.prepare_linears = prepare
row = run(model_arg, [q], DEFAULT_DATASET, 512, max_tokens, {"kv_cache_memory": 1 << 30})["rows"][0]
print(json.dumps({"perplexity": row["perplexity"], "tokens": row["scored_tokens"]}))
'''


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="model folder or .gguf (default: the bundled model)")
    p.add_argument("--max-tokens", type=int, default=16384)
    p.add_argument("--only", default="", help="run only the variants whose name contains this (and bf16)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rows = []
    for name, (q, keep, head, outliers) in VARIANTS.items():
        if a.only and name != "bf16" and a.only not in name:
            continue
        argv = [q, json.dumps(keep), head, str(a.max_tokens), a.model, outliers]
        proc = subprocess.run([sys.executable, "-c", CHILD, *argv],
                              capture_output=True, text=True)
        if proc.returncode != 0:  # e.g. Int8Linear's int32 logits of a 262k vocabulary: killed for memory
            rows.append({"variant": name, "error": f"exit status {proc.returncode}"})
            print(f"{name:45s} failed ({rows[-1]['error']})", flush=True)
            continue
        rows.append({"variant": name, **json.loads(proc.stdout.strip().splitlines()[-1])})
        base = rows[0]["perplexity"]
        print(f"{name:45s} {rows[-1]['perplexity']:.4f} ({rows[-1]['perplexity'] / base - 1:+.2%})", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model or "bundled", "max_tokens": a.max_tokens, "rows": rows, "method": "each variant in a fresh process"},
                      f, indent=1)


if __name__ == "__main__":
    main()
