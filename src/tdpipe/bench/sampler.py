"""Micro-benchmark of the engine's sampler on a large vocabulary: ``tdpipe bench sampler``.

Default: 256 rows x 262,144 columns (Gemma 3's vocabulary), float32 logits as the engine receives them,
mixed parameters cycling per row: greedy, top-p 0.9 at temperature 0.8, top-k 50, every 16th row with
logprobs=5, every other random row seeded. Real next-token distributions are mostly peaked, sometimes flat:
each row's logits are N(0, sigma^2) with sigma 5 (peaked: a top-p 0.9 nucleus of a few tokens) except every
`--flat-every`-th row, sigma 2.5 (thousands of tokens in the nucleus: the sampler's slow path). Also times
the lm_head matmul of that batch (bf16, `--hidden` wide) to put the sampler's share of a decode step in
proportion (the decoder layers come on top, so the true share is lower). The token ids' digest is printed:
the same seed and workload give the same digest before and after a sampler change.
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from typing import Any

import torch

from tdpipe.bench.machine import write_json
from tdpipe.sampling.metadata import SamplingMetadata
from tdpipe.sampling.params import SamplingParams
from tdpipe.sampling.sampler import Sampler
from tdpipe.sampling.seeds import draw_key


MIXES = ("mixed", "temperature")  # --mix: the module docstring's rows, or every row temperature 1 alone


def workload(batch: int, vocab: int, flat_every: int = 8, seed: int = 0,
             mix: str = "mixed") -> tuple[torch.Tensor, SamplingMetadata]:
    """The logits and per-row sampling inputs described in the module docstring (mix "temperature": every row
    at temperature 1 over the whole vocabulary, no top-k / top-p, as an RL rollout samples)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen)
    flat = [bool(flat_every) and i % flat_every == flat_every - 1 for i in range(batch)]
    sigma = torch.tensor([2.5 if f else 5.0 for f in flat])
    logits.mul_(sigma[:, None])
    kinds = ([SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9),
              SamplingParams(temperature=1.0, top_k=50)] if mix == "mixed" else [SamplingParams(temperature=1.0)])
    params, keys, lps = [], [], []
    for i in range(batch):
        base = kinds[i % len(kinds)]
        seeded = not base.is_greedy and (i // len(kinds)) % 2 == 0
        p = SamplingParams(temperature=base.temperature, top_p=base.top_p, top_k=base.top_k,
                           seed=i if seeded else None, logprobs=5 if i % 16 == 0 else None)
        params.append(p)
        keys.append(draw_key(i, 0) if seeded else None)
        lps.append(5 if p.logprobs else None)
    meta = SamplingMetadata(params, [[] for _ in params], [[] for _ in params], keys, None, lps)
    return logits, meta


def run(batch: int = 256, vocab: int = 262144, hidden: int = 640, iters: int = 5, flat_every: int = 8,
        threads: int = 0, mix: str = "mixed") -> dict[str, Any]:
    """Best and median seconds of `Sampler.sample` on the workload, the lm_head matmul's, and the digest of
    the sampled tokens (unseeded rows draw from torch's global generator, reseeded before every call)."""
    if threads:
        torch.set_num_threads(threads)
    logits, meta = workload(batch, vocab, flat_every, mix=mix)
    sampler = Sampler()
    times, digest = [], ""
    for it in range(iters + 1):
        torch.manual_seed(1234)
        t0 = time.perf_counter()
        tokens, lps = sampler.sample(logits, meta)
        dt = time.perf_counter() - t0
        if it:
            times.append(dt)
        digest = hashlib.sha1(repr((tokens, lps)).encode()).hexdigest()[:12]
    h = torch.randn(batch, hidden, dtype=torch.bfloat16)
    w = torch.randn(vocab, hidden, dtype=torch.bfloat16)
    head = []
    for it in range(3):
        t0 = time.perf_counter()
        torch.nn.functional.linear(h, w)
        head.append(time.perf_counter() - t0)
    return {"batch": batch, "vocab": vocab, "mix": mix, "threads": torch.get_num_threads(), "sample_best_s": min(times),
            "sample_median_s": statistics.median(times), "lm_head_best_s": min(head[1:]), "digest": digest}


def report(r: dict[str, Any]) -> str:
    share = r["sample_best_s"] / (r["sample_best_s"] + r["lm_head_best_s"])
    return (f"sampler ({r.get('mix', 'mixed')} rows), {r['batch']} rows x {r['vocab']} columns, "
            f"{r['threads']} threads: best {r['sample_best_s'] * 1e3:.1f} ms, median "
            f"{r['sample_median_s'] * 1e3:.1f} ms; lm_head (bf16) {r['lm_head_best_s'] * 1e3:.1f} ms; sampler / (sampler + lm_head) {share:.0%}; tokens digest "
            f"{r['digest']}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--vocab", type=int, default=262144)
    p.add_argument("--hidden", type=int, default=640, help="lm_head input width (Gemma 3 270M: 640)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--flat-every", type=int, default=8,
                   help="every n-th row has a flat distribution (0: none)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument("--mix", choices=MIXES, default="mixed",
                   help="mixed: greedy, top-p and top-k rows, some seeded, some with logprobs (module docstring); "
                        "temperature: every row at temperature 1 over the whole vocabulary, half of them seeded "
                        "(default: %(default)s)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")


def cmd(a: argparse.Namespace) -> int:
    r = run(a.batch, a.vocab, a.hidden, a.iters, a.flat_every, a.threads, a.mix)
    print(report(r))
    if a.json:
        write_json(a.json, r)
    return 0


def add_parser(bsub: Any) -> argparse.ArgumentParser:
    """`tdpipe bench sampler`."""
    p = bsub.add_parser("sampler", help="the sampler's time on a large vocabulary (Gemma 3: 262,144 columns)",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(fn=cmd)
    return p


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    cmd(p.parse_args(argv))


if __name__ == "__main__":
    main()
