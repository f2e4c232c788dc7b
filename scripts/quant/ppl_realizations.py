"""How far W8A8's perplexity moves between equally valid roundings: the engine's W8A8 perplexity (bench/
perplexity.py, same text and windows) with every per-row int8 scale (the activations' per token, and at load
the weights' per output channel) multiplied by (1 + k * 2^-23), for k = 0, 1, -1, 2, -2, ... A relative
change of about 1e-7 is far below bf16's precision (4e-3), so each k only decides which way some roundings
go, the next layer's int8 ones included: one more sample of the quantisation's rounding noise. The spread
of these runs is the resolution of any perplexity comparison under int8 on this model (a variant within it
is not better or worse). Each run in a fresh process (it patches model/int8_linear.py).

    .venv/bin/python scripts/quant/ppl_realizations.py \
        --json bench_results/quant/ppl_realizations_smollm2.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r'''
import json, sys
import tdpipe.model.int8_linear as il
from tdpipe.bench.perplexity import DEFAULT_DATASET, run  # `tdpipe bench perplexity`'s own loop
q, k, max_tokens, model_arg = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] or None
exact = il.quantize_rows
def shifted(x, rotate=False):
    qx, sx = exact(x, rotate)
    return qx, sx * (1 + k * 2.0 ** -23)
if k:
    il.quantize_rows = shifted  # Int8Linear (weights at load, activations per call) and the SwiGLU middle
row = run(model_arg, [q], DEFAULT_DATASET, 512, max_tokens, {"kv_cache_memory": 1 << 30})["rows"][0]
print(json.dumps({"perplexity": row["perplexity"], "tokens": row["scored_tokens"]}))
'''


def run(q: str, k: int, max_tokens: int, model: str) -> dict:
    argv = [q, str(k), str(max_tokens), model]
    proc = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{q} k={k} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="model folder or .gguf (default: the bundled model)")
    p.add_argument("--realizations", type=int, default=8, help="W8A8 runs: k = 0, 1, -1, 2, -2, ...")
    p.add_argument("--max-tokens", type=int, default=32768)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    base = run("none", 0, a.max_tokens, a.model)
    print(f"bf16 {base['perplexity']:.4f} ({base['tokens']} tokens)", flush=True)
    ks = [0] + [s * (i // 2 + 1) for i, s in zip(range(a.realizations - 1), [1, -1] * a.realizations)]
    rows = []
    for k in ks:
        r = run("w8a8", k, a.max_tokens, a.model)
        rows.append({"k": k, **r, "vs_bf16": r["perplexity"] / base["perplexity"] - 1})
        print(f"w8a8 k={k:+d} {r['perplexity']:.4f} ({rows[-1]['vs_bf16']:+.2%})", flush=True)
    costs = [r["vs_bf16"] for r in rows]
    summary = {"mean": statistics.mean(costs), "stdev": statistics.stdev(costs) if len(costs) > 1 else 0.0,
               "min": min(costs), "max": max(costs)}
    print(f"w8a8 vs bf16 over {len(rows)} realizations: mean {summary['mean']:+.2%}, "
          f"stdev {summary['stdev']:.2%}, range {summary['min']:+.2%} .. {summary['max']:+.2%}")
    if a.json:
        with open(a.json, "w") as f:
            method = "each run in a fresh process; k: scales x (1 + k 2^-23)"
            json.dump({"model": a.model or "bundled", "max_tokens": a.max_tokens, "bf16": base, "w8a8": rows,
                       "w8a8_vs_bf16": summary, "method": method}, f, indent=1)


if __name__ == "__main__":
    main()
