"""Where W8A8's perplexity cost comes from: a model's perplexity (bench/perplexity.py, same text) with every
linear int8 but one kind left in bf16, one kind at a time, and with the lm_head in bf16, as 8-bit blocks,
int8 per token in oneDNN (the engine's Int8Head), int8 per call (Int8Head's other mode) or per token
(Int8Linear), and with down_proj's outlier input channels taken out of its int8 GEMM and multiplied in
float (LLM.int8()'s decomposition, Dettmers et al., 2022: the channels whose largest |x| in the batch
passes 6, or the 32 largest). Each variant in a fresh process (it patches model/quantization.py).

    .venv/bin/python scripts/quant/ppl_ablation.py --json bench_results/quant/ppl_ablation.json
    .venv/bin/python scripts/quant/ppl_ablation.py --model SMOOTHED_FOLDER --max-tokens 8192
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

VARIANTS = {  # name -> (quantization, linears kept in bf16 besides the lm_head, how the head runs, what else:
    #   "rotate" the engine's rotation (int8_linear.ROTATE = 64); every other variant runs without it, then
    #   "thr:T" / "top:K" down_proj's outlier channels (|x| > T, the K largest) in float, or
    #   "rot:KIND:LINEARS" those linears' inputs rotated here in float64 by a whole-width Hadamard
    #   (Sylvester-Paley), a random orthogonal matrix, or Hadamard blocks of 64 ("block64"))
    "bf16": ("none", [], "bf16", ""),
    "w8a8 (the engine's: inputs rotated, head int8 per token in oneDNN)": ("w8a8", [], "per-row", "rotate"),
    "w8a8, inputs rotated, head 8-bit blocks": ("w8a8", [], "block", "rotate"),
    "w8a8 unrotated": ("w8a8", [], "block", ""),
    "w8a8 unrotated, head bf16": ("w8a8", [], "bf16", ""),
    "w8a8 unrotated + head int8 per call (Int8Head)": ("w8a8", [], "per-call", ""),
    "w8a8 unrotated + head int8 per token (Int8Linear)": ("w8a8", [], "per-token", ""),
    "w8a8 unrotated but qkv_proj bf16": ("w8a8", ["qkv_proj"], "block", ""),
    "w8a8 unrotated but o_proj bf16": ("w8a8", ["o_proj"], "block", ""),
    "w8a8 unrotated but gate_up_proj bf16": ("w8a8", ["gate_up_proj"], "block", ""),
    "w8a8 unrotated but down_proj bf16": ("w8a8", ["down_proj"], "block", ""),
    "w8a8 unrotated, down_proj's inputs past |x| = 6 in float": ("w8a8", [], "block", "thr:6"),
    "w8a8 unrotated, down_proj's 32 largest inputs in float": ("w8a8", [], "block", "top:32"),
    "w8a8, down_proj's input rotated (Hadamard)": ("w8a8", [], "block", "rot:hadamard:down_proj"),
    "w8a8, down_proj's input rotated (random orthogonal)": ("w8a8", [], "block", "rot:random:down_proj"),
    "w8a8, down_proj's and o_proj's inputs rotated (Hadamard)": ("w8a8", [], "block",
                                                                   "rot:hadamard:o_proj,down_proj"),
    "w8a8, down_proj's, qkv_proj's and gate_up_proj's inputs rotated (Hadamard)": (
        "w8a8", [], "block", "rot:hadamard:qkv_proj,gate_up_proj,down_proj"),
    "w8a8, every linear's input rotated (Hadamard)": ("w8a8", [], "block",
                                                       "rot:hadamard:qkv_proj,o_proj,gate_up_proj,down_proj"),
}

CHILD = r'''
import functools, json, sys
import torch
import tdpipe.model.int8_linear as il
import tdpipe.model.quantization as Q
from tdpipe.bench.perplexity import DEFAULT_DATASET, run  # `tdpipe bench perplexity`'s own loop
q, keep, head, max_tokens = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
model_arg, outliers = sys.argv[5] or None, sys.argv[6]
il.ROTATE = 64 if outliers == "rotate" else 0
orig = il.quantize_linears
def rotation(n, kind):
    """An orthonormal n x n matrix: Sylvester-Paley Hadamard (n = 2^a, 12 * 2^a or 20 * 2^a) or random."""
    if kind.startswith("block"):  # block-diagonal: a Hadamard of size b on each b-wide slice of the input
        b = int(kind[5:])
        return torch.block_diag(*[rotation(b, "hadamard")] * (n // b))
    if kind == "random":
        g = torch.Generator().manual_seed(0)
        return torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))[0]
    h, m = torch.ones(1, 1, dtype=torch.float64), n
    for base in (12, 20):
        while m % base == 0:
            qr = {(i * i) % (base - 1) for i in range(1, base - 1)}
            chi = lambda d: 0 if d % (base - 1) == 0 else (1 if d % (base - 1) in qr else -1)
            q = torch.tensor([[chi(j - i) for j in range(base - 1)] for i in range(base - 1)],
                             dtype=torch.float64)
            s = torch.zeros(base, base, dtype=torch.float64)
            s[0, 1:], s[1:, 0], s[1:, 1:] = 1, -1, q
            h, m = torch.kron(h, s + torch.eye(base, dtype=torch.float64)), m // base
    while m > 1:
        h, m = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0), m // 2
    assert h.shape == (n, n) and torch.allclose(h @ h.T, n * torch.eye(n, dtype=torch.float64)), n
    return h / n ** 0.5
ROT = {}
def prepare(model, method, gguf_file="", folder=""):  # Q.prepare_linears with the variant's choices
    if method == "w8a8" and outliers.startswith("rot:"):
        _, kind, names = outliers.split(":")
        for mod in model.modules():
            for name in names.split(","):
                d = getattr(mod, name, None)
                if isinstance(d, torch.nn.Linear):
                    r = ROT.setdefault(d.in_features, rotation(d.in_features, kind))
                    d.weight.data = (d.weight.double() @ r).to(d.weight.dtype)
                    d.rotated = True
    n = orig(model, skip=("lm_head", *keep)) if method == "w8a8" else 0
    if method == "w8a8":
        Q.fuse_swiglu(model)  # the engine's one-pass SwiGLU middle, or split_down below
    if outliers.startswith("rot:"):
        rotate_inputs(model)
    if method == "w8a8" and head == "block":
        from tdpipe.model.block_linear import BlockLinear
        model.lm_head = BlockLinear.from_float(model.lm_head, 8)
    elif method == "w8a8" and head != "bf16":
        model.lm_head = (functools.partial(il.Int8Head, per_row=False) if head == "per-call" else
                         il.Int8Head if head == "per-row" else il.Int8Linear)(model.lm_head)
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
def rotated(lin, f, h):
    """lin(h R), R the rotation folded into lin's weight at load: the int8 quantisation sees h R."""
    return f((h.double() @ ROT[lin.in_features]).to(torch.float32)).to(h.dtype)
def rotate_inputs(model):
    for mod in list(model.modules()):
        for name in outliers.split(":")[2].split(","):
            lin = getattr(mod, name, None)
            if isinstance(lin, il.Int8Linear):
                lin.forward = functools.partial(rotated, lin, lin.forward)
def fuse_split(model):
    n = 0
    for m in model.modules():
        if isinstance(getattr(m, "down_proj", None), il.Int8Linear):
            f = (lambda d, h: d(h)) if outliers.startswith("rot:") else split_down
            m.fused = functools.partial(lambda gu, d, act, x, f=f: f(d, act(gu(x))), m.gate_up_proj,
                                        m.down_proj, m.act)
            n += 1
    return n
if outliers and outliers != "rotate":
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
