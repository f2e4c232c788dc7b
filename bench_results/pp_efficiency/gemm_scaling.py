"""Why pp = 2 (one thread per stage) stays below pp = 1 (two threads) on this machine: one decoder layer's
four bf16 linears (Qwen2.5-0.5B or SmolLM2 shapes; the engine's packed oneDNN linear) timed per micro-batch size M, on 1 and 2 threads, in
fresh processes. pp = 2 splits a running batch of B rows into two micro-batches of B / 2, each stage one
thread over half the layers, so its ceiling (no bubble at all) is 2 * r1(B / 2) / r2(B), r_t(M) = rows/s of
one layer on t threads at M rows.

  .venv/bin/python bench_results/pp_efficiency/gemm_scaling.py --json bench_results/pp_efficiency/gemm_scaling.json
"""
import argparse
import json
import os
import subprocess
import sys
import time

SHAPES = {  # (out, in) of q/k/v fused, o, gate/up fused, down
    "qwen2.5-0.5b": [(1152, 896), (896, 896), (9728, 896), (896, 4864)],
    "smollm2-135m": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
}
SIZES = [16, 32, 64, 128, 256, 512]


def child(model: str, threads: int) -> dict:
    """rows/s per M through the engine's own bf16 linear (tdpipe.model.packed_linear: weights packed once)."""
    import torch

    from tdpipe.model.packed_linear import PackedLinear

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    layers = []
    for o, i in SHAPES[model]:
        lin = torch.nn.Linear(i, o, bias=False).bfloat16()
        with torch.no_grad():
            lin.weight.copy_(torch.randn(o, i, generator=g))
        layers.append((i, PackedLinear(lin)))
    out = {}
    with torch.inference_mode():
        for m in SIZES:
            xs = {i: torch.randn(m, i, generator=g).bfloat16() for i, _ in layers}
            for _ in range(3):
                for i, lin in layers:
                    lin(xs[i])
            best = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(10):
                    for i, lin in layers:
                        lin(xs[i])
                best = min(best, (time.perf_counter() - t) / 10)
            out[m] = m / best
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    p.add_argument("--child", nargs=2, default=None)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], int(a.child[1]))))
        return
    import platform

    res = {"machine": platform.processor() or platform.machine(), "rows_per_s": {}, "pp2_ceiling": {}}
    try:
        res["machine"] = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    for model in SHAPES:
        r = {}
        for t in (1, 2):
            out = subprocess.run([sys.executable, __file__, "--child", model, str(t)], capture_output=True, text=True,
                                 check=True, env={**os.environ, "OMP_NUM_THREADS": str(t)}).stdout
            r[t] = {int(k): v for k, v in json.loads(out).items()}
        res["rows_per_s"][model] = {f"{t} threads": r[t] for t in r}
        res["pp2_ceiling"][model] = {b: 2 * r[1][b // 2] / r[2][b] for b in SIZES if b // 2 in r[1]}
        print(f"{model}: rows/s of one layer's linears (1 thread | 2 threads) and pp=2's ceiling 2*r1(B/2)/r2(B)")
        for b in SIZES:
            c = res["pp2_ceiling"][model].get(b)
            print(f"  M {b:4d}: {r[1][b]:9.0f} | {r[2][b]:9.0f}" + (f"   B = {b}: ceiling {c:.2f}x" if c else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
