"""Micro-benchmark of the paged-attention kernel: ``python -m tdpipe.bench.attention``.

Decode at the SmolLM2-135M shape by default (batch 256, context 1024, Hq=9, Hkv=3, D=64, bf16): ms per
layer, effective bandwidth (K+V bytes read / time), the pure-torch reference for comparison, store_kv,
and a chunked-prefill case. The 30-layer run cycles through 30 distinct layer caches (as the engine does),
so nothing stays in the last-level cache between calls. `--device cuda` times the Triton kernels
(model/triton_attention.py; run on an H200); `--backend triton` runs them on CPU tensors through
Triton's interpreter (correctness of the bench's own path only: use tiny shapes, the times mean nothing).
`--softcap C` caps the scores as Gemma 2 does (C tanh(s / C)); `--json FILE` writes the figures too.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from tdpipe.config import KV_CACHE_DTYPES
from tdpipe.model import kv_quant
from tdpipe.model import paged_attention as pa

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _sync() -> None:
    """Wait for queued CUDA work, so a host timer measures it; nothing on CPU."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _time(fn: Callable[[], object], iters: int, warmup: int = 1) -> tuple[float, float]:
    """(median, best) seconds per call; best is the better guide on a machine shared with other jobs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def _block_tables(batch: int, blocks_per_seq: int, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """Each sequence gets random, non-contiguous blocks (as after a while of allocation churn)."""
    perm = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per_seq]
    return perm.view(batch, blocks_per_seq).to(torch.int32).contiguous()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="q's dtype, and the cache's with "
                   "--kv-cache-dtype auto")
    p.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                   help="int8: one byte per element and a scale per row (model/kv_quant.py)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument("--no-ref", action="store_true", help="skip the (slow) reference implementation")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: the Triton kernels")
    p.add_argument("--backend", choices=list(pa.BACKENDS), default="auto",
                   help="triton: the Triton kernels on CPU tensors too (interpreted: tiny shapes only)")
    p.add_argument("--softcap", type=float, default=0.0,
                   help="attention logit soft-cap C (Gemma 2's attn_logit_softcapping, 50): scores become "
                        "C tanh(s / C); 0: none")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")
    args = p.parse_args(argv)
    if args.softcap < 0:
        p.error(f"--softcap must be >= 0, got {args.softcap}")
    result: dict[str, object] = {"args": vars(args)}

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = _DTYPES[args.dtype]
    b, ctx, hq, hkv, d, bs, nl = (args.batch, args.context, args.q_heads, args.kv_heads, args.head_dim,
                                  args.block_size, args.layers)
    gen = torch.Generator().manual_seed(0)
    dev = torch.device(args.device)
    pa.set_attention_backend(args.backend)

    if pa.use_triton(torch.empty(0, device=dev)):
        print(f"kernel: triton ({'interpreted' if dev.type == 'cpu' else 'compiled'})")
    else:
        t0 = time.perf_counter()
        kern = pa.load_kernel()
        result["kernel"] = "torch" if kern is None else kern.kernel_info()
        print(f"kernel: {'unavailable (pure-torch path)' if kern is None else kern.kernel_info()}, "
              f"load/build {time.perf_counter() - t0:.1f} s")

    blocks_per_seq = -(-ctx // bs)
    num_blocks = b * blocks_per_seq + 16
    # One big tensor like the engine's; layer 0 random, the others copies (fast to fill, same bytes read).
    cache_dtype, width = kv_quant.cache_layout(args.kv_cache_dtype, dtype, d)
    cache = torch.empty((nl, 2, num_blocks, hkv, bs, width), dtype=cache_dtype, device=dev)
    rows = torch.randn((2, num_blocks, hkv, bs, d), generator=gen)
    cache[0].copy_(kv_quant.quantize_rows(rows) if kv_quant.is_int8(cache) else rows.to(dtype))
    for layer in range(1, nl):
        cache[layer].copy_(cache[0])
    bt = _block_tables(b, blocks_per_seq, num_blocks, gen).to(dev)
    cu = torch.arange(b + 1, dtype=torch.int32, device=dev)
    lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn((b, hq, d), generator=gen).to(device=dev, dtype=dtype)
    scale = d ** -0.5

    kv_bytes = b * ctx * hkv * width * 2 * cache.element_size()
    kv_name = "" if args.kv_cache_dtype == "auto" else f", {args.kv_cache_dtype} cache"
    print(f"decode: batch {b}, context {ctx}, Hq {hq}, Hkv {hkv}, D {d}, block {bs}, {args.dtype}{kv_name}, "
          f"{torch.get_num_threads()} threads; K+V per layer {kv_bytes / 1e6:.1f} MB")

    def layer_call(layer: int) -> torch.Tensor:
        return pa.paged_attention(q, cache[layer, 0], cache[layer, 1], bt, cu, lens, scale, softcap=args.softcap)

    t1, b1 = _time(lambda: layer_call(0), args.iters, warmup=2)
    print(f"  1 layer (same cache):  {t1 * 1e3:7.2f} ms/layer  {kv_bytes / t1 / 1e9:6.1f} GB/s  "
          f"(best {b1 * 1e3:.2f} ms, {kv_bytes / b1 / 1e9:.1f} GB/s)")

    def all_layers() -> None:
        for layer in range(nl):
            layer_call(layer)

    tn, bn = (x / nl for x in _time(all_layers, max(2, args.iters // 3)))
    print(f"  x{nl} layers:            {tn * 1e3:7.2f} ms/layer  {kv_bytes / tn / 1e9:6.1f} GB/s  "
          f"({tn * nl * 1e3:.1f} ms per step; best {bn * 1e3:.2f} ms/layer, {kv_bytes / bn / 1e9:.1f} GB/s)")
    result["decode"] = {"one_layer_ms": t1 * 1e3, "one_layer_best_ms": b1 * 1e3, "per_layer_ms": tn * 1e3,
                        "per_layer_best_ms": bn * 1e3, "kv_bytes_per_layer": kv_bytes,
                        "gb_per_s": kv_bytes / tn / 1e9}

    if not args.no_ref:
        out = layer_call(0)
        _sync()
        tr0 = time.perf_counter()
        ref = pa.paged_attention_ref(q, cache[0, 0], cache[0, 1], bt, cu, lens, scale, softcap=args.softcap)
        _sync()
        tr = time.perf_counter() - tr0
        err = (out.float() - ref.float()).abs().max().item()
        print(f"  reference:             {tr * 1e3:7.2f} ms/layer  {kv_bytes / tr / 1e9:6.1f} GB/s  "
              f"(kernel {tr / t1:.0f}x faster, max |diff| {err:.2e})")
        result["reference"] = {"ms": tr * 1e3, "max_abs_diff": err}

    # store_kv: one decode step's new tokens, and a prefill-sized batch.
    for ntok in (b, min(8192, num_blocks * bs)):
        k = torch.randn((ntok, hkv, d), generator=gen).to(device=dev, dtype=dtype)
        v = torch.randn((ntok, hkv, d), generator=gen).to(device=dev, dtype=dtype)
        slots = torch.randperm(num_blocks * bs, generator=gen)[:ntok].to(dev)
        def store(k=k, v=v, slots=slots) -> None:
            pa.store_kv(k, v, cache[0, 0], cache[0, 1], slots)

        def store_ref(k=k, v=v, slots=slots) -> None:
            pa.store_kv_ref(k, v, cache[0, 0], cache[0, 1], slots)

        ts, _ = _time(store, args.iters * 3)
        msg = f"  store_kv {ntok:5d} tokens: {ts * 1e6:8.1f} us"
        if not args.no_ref:
            tsr, _ = _time(store_ref, args.iters)
            msg += f"  (reference {tsr * 1e6:.1f} us)"
        print(msg)

    # Chunked prefill: 4 sequences each adding 256 queries on top of a 768-token cached prefix.
    ns, chunk = 4, 256
    if ns * blocks_per_seq <= num_blocks and chunk <= ctx:
        qc = torch.randn((ns * chunk, hq, d), generator=gen).to(device=dev, dtype=dtype)
        cuc = torch.arange(0, ns * chunk + 1, chunk, dtype=torch.int32, device=dev)
        lc = torch.full((ns,), ctx, dtype=torch.int32, device=dev)
        kc, vc, btc = cache[0, 0], cache[0, 1], bt[:ns]
        tc, _ = _time(lambda: pa.paged_attention(qc, kc, vc, btc, cuc, lc, scale, softcap=args.softcap), args.iters)
        flops = 4 * d * hq * sum(ctx - chunk + j + 1 for j in range(chunk)) * ns
        msg = (f"chunked prefill: {ns} x {chunk} queries over {ctx} keys: {tc * 1e3:.2f} ms  "
               f"{flops / tc / 1e9:.1f} GFLOP/s")
        result["chunked_prefill"] = {"ms": tc * 1e3, "gflop_per_s": flops / tc / 1e9}
        if not args.no_ref:
            tcr, _ = _time(lambda: pa.paged_attention_ref(qc, kc, vc, btc, cuc, lc, scale, softcap=args.softcap), 2)
            msg += f"  (reference {tcr * 1e3:.2f} ms)"
        print(msg)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
