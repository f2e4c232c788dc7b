"""Tune the Triton split-K decode kernel (model/triton_attention.py) on a GPU: time one decode attention call
at batch 256 for tiles (BLOCK_N keys), warps, pipeline stages and partition sizes, at the bundled model's and
Llama-3-8B's attention shapes, with the block table as wide as under a CUDA graph (max_model_len 8,192) and
contexts of the gpu-check workload (129-256 tokens); then the best configuration's time split into the decode
kernel alone and the reduce alone at 1, 2 and 4 warps. Prints a table and writes JSON (achieved KV bandwidth =
K and V bytes read / time).

    PYTHONPATH=src python3 scripts/gpu_decode_tune.py [OUT.json] [--shapes=bundled,llama8b] [--fine] [--quick]

--fine: tiles x warps x stages (16-64 keys, 1-4 warps, 1-3 stages) at 512-key partitions instead of the two
rounds (tiles and warps, then stages and partition sizes for the best); --quick: CPU, tiny, interpreted.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from unittest import mock

import torch
import triton

from tdpipe.model import triton_attention as ta

SHAPES = {"bundled": (3, 3, 64), "llama8b": (8, 4, 128)}  # (KV heads, query heads per KV head, head dim)


def setup(hkv: int, g: int, d: int, seqs: int, max_len: int, dev: str, bs: int = 16) -> dict:
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(129, 257, (seqs,), generator=gen, dtype=torch.int32) if max_len > 256 else \
        torch.full((seqs,), max_len // 2, dtype=torch.int32)
    need = int(sum((int(n) + bs - 1) // bs for n in lens))
    blocks = torch.randperm(need + 1, generator=gen)[:need].to(torch.int32) + 1
    width = max_len // bs
    bt = torch.zeros(seqs, width, dtype=torch.int32)
    k = 0
    for s, n in enumerate(lens.tolist()):
        nb = (n + bs - 1) // bs
        bt[s, :nb] = blocks[k:k + nb]
        k += nb
    kc = torch.randn(need + 2, hkv, bs, d, generator=gen).to(torch.bfloat16)
    vc = torch.randn(need + 2, hkv, bs, d, generator=gen).to(torch.bfloat16)
    q = torch.randn(seqs, hkv * g, d, generator=gen).to(torch.bfloat16)
    cu = torch.arange(seqs + 1, dtype=torch.int32)
    to = {"device": dev}
    return {"q": q.to(**to), "kc": kc.to(**to), "vc": vc.to(**to), "bt": bt.to(**to), "cu": cu.to(**to),
            "lens": lens.to(**to), "bytes": int(lens.sum()) * hkv * d * 2 * 2, "g": g, "hkv": hkv, "d": d,
            "bs": bs}


def engine_path(x: dict, block_n: int, warps: int, stages: int, part: int) -> torch.Tensor:
    """The engine's own call (triton_attention.paged_attention, scratch and reduce included) with its decode
    tiles pinned to this configuration: what the sweep times."""
    with mock.patch.object(ta, "decode_tiles", lambda head_dim, partition_size: (block_n, warps, stages)):
        return ta.paged_attention(x["q"], x["kc"], x["vc"], x["bt"], x["cu"], x["lens"], x["d"] ** -0.5,
                                  partition_size=part)


def launch(x: dict, kern, block_n: int, warps: int, stages: int, part: int, reduce_warps: int | None = None,
           parts: str = "both", scratch: tuple | None = None) -> tuple[torch.Tensor, tuple]:
    """The decode kernel and, where the table splits into partitions, the reduce, launched apart for the
    winner's time split (`parts`: "both", "decode" or "reduce", the last over `scratch` from an earlier
    decode), which paged_attention cannot do. Returns the output and the scratch."""
    q, kc, vc, bt, cu, lens = x["q"], x["kc"], x["vc"], x["bt"], x["cu"], x["lens"]
    seqs, hq, d = q.shape
    num_parts = triton.cdiv(bt.shape[1] * x["bs"], part)
    split = num_parts > 1
    if scratch is None:
        out = torch.empty_like(q)
        pm = torch.empty((seqs, hq, num_parts), dtype=torch.float32, device=q.device) if split else out
        pl = torch.empty((seqs, hq, num_parts), dtype=torch.float32, device=q.device) if split else out
        po = torch.empty((seqs, hq, num_parts, d), dtype=torch.float32, device=q.device) if split else out
        scratch = (out, pm, pl, po)
    out, pm, pl, po = scratch
    strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
               bt.stride(0))
    scale = d ** -0.5 * 1.4426950408889634
    extra = {} if kern.interpreted else {"num_warps": warps, "num_stages": stages}
    red = {} if kern.interpreted or reduce_warps is None else {"num_warps": reduce_warps}
    with ta.launching(kern):
        if parts != "reduce":
            kern.decode[(seqs, x["hkv"], num_parts)](
                q, kc, vc, out, pm, pl, po, bt, cu, lens, *strides, hq, num_parts, d, x["bs"], scale, 0, part, 0.0,
                G=x["g"], BLOCK_G=max(16, ta.pow2(x["g"])), BLOCK_N=block_n, BLOCK_D=max(16, ta.pow2(d)),
                USE_WINDOW=False, SPLIT=split, FP32_DOT=kern.interpreted, SOFTCAP=False, **extra)
        if split and parts != "decode":
            kern.reduce[(seqs, hq)](out, pm, pl, po, cu, lens, out.stride(0), out.stride(1), hq, num_parts, d, part,
                                    BLOCK_P=ta.pow2(num_parts), BLOCK_D=max(16, ta.pow2(d)), **red)
    return out, scratch


def timed(fn, reps: int, cuda: bool) -> float:
    """Seconds per call of fn. On a GPU fn is captured once in a CUDA graph and the graph replayed: a Triton
    launch costs tens of microseconds of Python, as much as a small model's whole decode kernel, so launching
    from Python would time the host (the engine replays graphs too)."""
    for _ in range(3):
        fn()
    if not cuda:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3 / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?", default="decode_tune.json", help="JSON to write (default: %(default)s)")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--fine", action="store_true", help="tiles x warps x stages at 512-key partitions")
    p.add_argument("--quick", action="store_true", help="CPU, tiny, interpreted")
    a = p.parse_args()
    quick, fine, shapes, out_path = a.quick, a.fine, a.shapes.split(","), a.out
    cuda = torch.cuda.is_available() and not quick
    dev = "cuda" if cuda else "cpu"
    kern = ta._kernels(not cuda)
    seqs, max_len = (256, 8192) if cuda else (4, 64)
    rows = []
    t_start = time.perf_counter()
    for name, (hkv, g, d) in SHAPES.items():
        if name not in shapes:
            continue
        x = setup(hkv, g, d, seqs, max_len, dev)
        ref = ta.paged_attention(x["q"], x["kc"], x["vc"], x["bt"], x["cu"], x["lens"], d ** -0.5).float()
        first = [(bn, w, 3, 512) for bn, w in itertools.product((16, 32, 64, 128), (1, 2, 4, 8))]
        second = [(None, None, st, p) for st, p in itertools.product((1, 2, 3, 4), (128, 256, 512))]
        if fine:  # every tile x warps x stages near the first round's winners, one partition size
            first, second = [(bn, w, st, 512) for bn, w, st in itertools.product((16, 32, 64), (1, 2, 4),
                                                                                  (1, 2, 3))], []
        if quick:
            first, second = first[:2], second[:2]
        best = None
        for stage, configs in (("tile", first), ("pipeline", second)):
            for bn, w, st, p in configs:
                if bn is None:
                    bn, w = best["block_n"], best["warps"]
                if p < bn or (cuda and p > max_len):
                    continue
                try:
                    o = engine_path(x, bn, w, st, p)
                    err = float((o.float() - ref).abs().max())
                    sec = timed(lambda: engine_path(x, bn, w, st, p), 50 if fine else 20, cuda)
                except Exception as e:  # a tile that does not compile (shared memory): recorded, skipped
                    rows.append({"shape": name, "stage": stage, "block_n": bn, "warps": w, "stages": st,
                                 "partition": p, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                    continue
                r = {"shape": name, "stage": stage, "block_n": bn, "warps": w, "stages": st, "partition": p,
                     "us": sec * 1e6, "tb_s": x["bytes"] / sec / 1e12, "max_abs_err": err}
                rows.append(r)
                print(f"{name:8} {stage:8} BLOCK_N={bn:3} warps={w} stages={st} part={p:4}: {r['us']:8.1f} us "
                      f"{r['tb_s']:.2f} TB/s err {err:.3g}", flush=True)
                if stage == "tile" and (best is None or r["us"] < best["us"]):
                    best = r
        win = min((r for r in rows if r["shape"] == name and "us" in r), key=lambda r: r["us"])
        # the winner's time split: decode alone, and the reduce alone at 1, 2, 4 warps (its grid is one
        # program per (sequence, query head), nearly all of which find a one-partition sequence and stop)
        cfg = (win["block_n"], win["warps"], win["stages"], win["partition"])
        _, scr = launch(x, kern, *cfg)
        split = {"decode_us": timed(lambda: launch(x, kern, *cfg, parts="decode", scratch=scr), 50, cuda) * 1e6}
        for rw in (1, 2, 4):
            split[f"reduce_us_warps{rw}"] = timed(
                lambda: launch(x, kern, *cfg, reduce_warps=rw, parts="reduce", scratch=scr), 50, cuda) * 1e6
        rows.append({"shape": name, "stage": "split", "block_n": cfg[0], "warps": cfg[1], "stages": cfg[2],
                     "partition": cfg[3], **split})
        print(f"{name:8} split    {cfg}: " + ", ".join(f"{k} {v:.1f}" for k, v in split.items()), flush=True)
        cur = [r for r in rows if r["shape"] == name and r.get("block_n") == 64 and r.get("warps") == 4
               and r.get("stages") == 3 and r.get("partition") == 512 and "us" in r]
        print(f"{name}: best {win} vs current {cur[0]['us'] if cur else None} us", flush=True)
    doc = {"device": torch.cuda.get_device_name() if cuda else "cpu (interpreted, tiny)",
           "torch": torch.__version__, "triton": triton.__version__, "seqs": seqs, "max_model_len": max_len,
           "seconds": time.perf_counter() - t_start, "rows": rows}
    with open(out_path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {out_path} in {doc['seconds']:.0f} s")


if __name__ == "__main__":
    main()
