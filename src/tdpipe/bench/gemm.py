"""GEMM paths side by side on this CPU: ``tdpipe bench gemm``.

For each linear of a model (qkv, o, gate_up, down, lm_head: their [N, K] from the config) and each row count
M (decode micro-batches and a prefill chunk), the best of `--iters` timed calls of:

  bf16           F.linear on a bf16 weight (oneDNN reorders the weight on every call)
  bf16-packed    the engine's bf16 path: the weight prepacked for oneDNN once (model/packed_linear.py)
  bf16-upcast    the engine's bf16 path on a CPU without bf16 instructions: the bf16 weight widened to
                 float32 a cache-sized slice at a time, then a float32 GEMM (model/upcast_linear.py)
  fp32-packed    the engine's float32 path: a float32 weight prepacked for oneDNN, float32 activations
  int8-mm        torch._int_mm alone: s8 x s8 -> s32 (oneDNN; VNNI where the CPU has it), no scaling
  int8-onednn    torch.ops.onednn.qlinear_pointwise alone, the weight prepacked once, activations u8 with
                 zero point 128 (its s8-activation path is a reference loop, far slower), fp32 out, no scaling
  w8a8           the engine's W8A8 linear: per-token quantisation + torch._int_mm + scaling to bf16
                 (model/int8_linear.py, csrc/int8.cpp); without VNNI the same integer sums in float32
                 arithmetic on the widened int8 weight
  w8a8-head      W8A8's lm_head (Int8Head): per-token int8 activations, rotated, in oneDNN's prepacked int8
                 linear writing bf16, each row then scaled (torch._int_mm's int32 output at the lm_head's
                 shape outgrows the cache); on a CPU without VNNI the engine's head is w8a8-block instead
  w4a8-block     the engine's `--quantization gguf` / `awq` linear on 4-bit weights (a Q4_0 / Q4_1 / Q4_K
                 file, an AWQ folder):
                 int8 activations per block of 32 + tdpipe's block GEMM on the packed nibbles, unpacked in
                 registers (AVX-512 VNNI, AVX2 or portable loops), writing bf16 (model/block_linear.py,
                 csrc/qgemm.cpp)
  w8a8-block     the same on 8-bit blocks (a Q8_0 / Q5_0 tensor, the GGUF's embedding as the tied lm_head,
                 W8A8's lm_head without VNNI)

GOP/s = 2 M N K / seconds (multiply-adds count two operations, int8 or bf16 alike), same run, same threads.
The quantisation paths for W8A8 were chosen by this measurement: see docs/quantization.md.
"""
from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.nn.functional as F

from tdpipe.bench.machine import write_json
from tdpipe.model.block_linear import BlockLinear
from tdpipe.model.cpu_ops import kernel
from tdpipe.model.int8_linear import Int8Head, Int8Linear, onednn_head_dtype
from tdpipe.model.packed_linear import PackedLinear, packing_available
from tdpipe.model.upcast_linear import UpcastLinear

DEFAULT_MODELS = ("smollm2-135m", "qwen2.5-0.5b")
DEFAULT_ROWS = (16, 128, 256, 2048)
PATHS = ("bf16", "bf16-packed", "bf16-upcast", "fp32-packed", "int8-mm", "int8-onednn", "w8a8", "w8a8-head",
         "w4a8-block", "w8a8-block")


def model_shapes(name: str) -> list[tuple[str, int, int]]:
    """(linear, N, K) of a shipped config (simulator models and model/configs)."""
    from tdpipe.bench.gpu_check import model_config
    from tdpipe.model.random_model import published_config

    try:
        cfg = published_config(name)
    except (ValueError, KeyError, FileNotFoundError):
        cfg = model_config(name)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim") or h // heads
    return [("qkv", (heads + 2 * kv) * d, h), ("o", h, heads * d), ("gate_up", 2 * inter, h),
            ("down", h, inter), ("lm_head", cfg["vocab_size"], h)]


def _best(fn: Any, iters: int) -> float:
    fn()
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def skipped_paths() -> dict[str, str]:
    """The paths this CPU and torch build cannot run, each with why (the table leaves them out)."""
    why = {}
    if not packing_available():
        why["bf16-packed"] = "oneDNN's prepacked bf16 linear is missing or inexact here (no avx512_bf16?)"
    if onednn_head_dtype(torch.bfloat16) is None:
        why["w8a8-head"] = "oneDNN's prepacked int8 linear is missing or computes wrongly here"
    return why


def time_shape(m: int, n: int, k: int, iters: int, paths: tuple[str, ...] = PATHS) -> dict[str, float]:
    """Seconds (best of `iters`) of each path for x [m, k] @ W[n, k]^T."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(torch.bfloat16)
    lin = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
    lin.weight.data.copy_(w)
    out: dict[str, float] = {}
    skipped = skipped_paths()
    for p in paths:
        if p == "bf16":
            out[p] = _best(lambda: F.linear(x, w), iters)
        elif p in skipped:
            continue
        elif p == "bf16-packed":
            packed = PackedLinear(lin)
            out[p] = _best(lambda: packed(x), iters)
        elif p == "bf16-upcast":
            up = UpcastLinear(lin)
            out[p] = _best(lambda: up(x), iters)
        elif p == "fp32-packed":
            lin32 = torch.nn.Linear(k, n, bias=False)  # a copy: lin.float() would convert lin itself
            lin32.weight.data.copy_(w.float())
            p32, x32 = PackedLinear(lin32), x.float()
            out[p] = _best(lambda: p32(x32), iters)
        elif p == "int8-mm":
            q = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8)
            qw = torch.randint(-127, 128, (k, n), generator=gen, dtype=torch.int8)
            out[p] = _best(lambda: torch._int_mm(q, qw), iters)
        elif p == "int8-onednn":
            qx = torch.randint(0, 256, (m, k), generator=gen, dtype=torch.uint8)
            qw8 = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
            pw = torch.ops.onednn.qlinear_prepack(qw8, [m, k])
            ones, zeros = torch.ones(n), torch.zeros(n, dtype=torch.int64)
            out[p] = _best(lambda: torch.ops.onednn.qlinear_pointwise(qx, 1.0, 128, pw, ones, zeros, None, 1.0, 0,
                                                                      torch.float32, "none", [], ""), iters)
        elif p == "w8a8":
            q8 = Int8Linear(lin)
            out[p] = _best(lambda: q8(x), iters)
        elif p == "w8a8-head":
            h8 = Int8Head(lin)
            out[p] = _best(lambda: h8(x), iters)
        elif p in ("w4a8-block", "w8a8-block"):
            bl = BlockLinear.from_float(lin.float(), 4 if p == "w4a8-block" else 8)
            out[p] = _best(lambda: bl(x), iters)
    return out


def run(models: tuple[str, ...] = DEFAULT_MODELS, rows: tuple[int, ...] = DEFAULT_ROWS, iters: int = 5,
        threads: int = 0, paths: tuple[str, ...] = PATHS) -> dict[str, Any]:
    if threads:
        torch.set_num_threads(threads)
    results = []
    for model in models:
        for name, n, k in model_shapes(model):
            for m in rows:
                secs = time_shape(m, n, k, iters, paths)
                ops = 2 * m * n * k
                results.append({"model": model, "linear": name, "m": m, "n": n, "k": k,
                                "seconds": secs, "gops": {p: ops / s / 1e9 for p, s in secs.items()}})
    return {"threads": torch.get_num_threads(), "iters": iters, "int8_kernel": kernel() is not None,
            "packed_bf16": packing_available(), "skipped": skipped_paths(), "results": results}


def table(r: dict[str, Any]) -> str:
    paths = [p for p in PATHS if any(p in x["gops"] for x in r["results"])]
    # each against the engine's float path, where both ran (a ratio to a path not run is no figure): bf16
    # where the CPU runs it packed, else float32 (the default dtype there)
    ref = "bf16-packed" if "bf16-packed" in paths else "fp32-packed"
    ratios = [q for q in ("w8a8", "w4a8-block") if q in paths and ref in paths]
    cols = [f"{p} GOP/s" for p in paths] + [f"{q} / {ref}" for q in ratios]
    lines = ["| model | linear | M x N x K | " + " | ".join(cols) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in cols) + " |"]
    for x in r["results"]:
        g = x["gops"]
        cells = [f"{g[q] / g[ref]:.2f}x" if q in g and ref in g else "-" for q in ratios]
        lines.append(f"| {x['model']} | {x['linear']} | {x['m']} x {x['n']} x {x['k']} | "
                     + " | ".join([f"{g[p]:.0f}" if p in g else "-" for p in paths] + cells) + " |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help="shipped configs whose linear shapes are timed, comma-separated (default: %(default)s)")
    p.add_argument("--rows", default=",".join(map(str, DEFAULT_ROWS)),
                   help="M, the token rows per call, comma-separated (default: %(default)s)")
    p.add_argument("--paths", default=",".join(PATHS), help="which paths (default: %(default)s)")
    p.add_argument("--iters", type=int, default=5, help="timed calls per path and shape; the best counts")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")


def cmd(a: argparse.Namespace) -> int:
    paths = tuple(s for s in a.paths.split(",") if s)
    bad = [s for s in paths if s not in PATHS]
    if bad:
        raise SystemExit(f"tdpipe bench gemm: --paths: unknown {bad}; the paths are {list(PATHS)}")
    r = run(tuple(a.models.split(",")), tuple(int(v) for v in a.rows.split(",")), a.iters, a.threads, paths)
    print(f"GEMM paths, {r['threads']} threads (best of {r['iters']}); int8 kernel: "
          f"{'built' if r['int8_kernel'] else 'unavailable (torch fallback)'}")
    for p, why in skipped_paths().items():
        if p in paths:
            print(f"not run: {p}: {why}")
    print(table(r))
    if a.json:
        write_json(a.json, r)
    return 0


def add_parser(bsub: Any) -> argparse.ArgumentParser:
    """`tdpipe bench gemm`."""
    p = bsub.add_parser("gemm", help="GOP/s of the bf16, int8 (W8A8) and block-quantised (W4A8) GEMM paths at a "
                                     "model's linear shapes",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(fn=cmd)
    return p
