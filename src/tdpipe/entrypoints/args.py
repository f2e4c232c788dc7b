"""Command-line flags shared by every subcommand that builds an engine, and their mapping to LLM(...)."""
from __future__ import annotations

import argparse
from typing import Any


def _memory(v: str) -> int | float:
    """'0.3' is a fraction of available memory; '2GiB', '512MiB' or a plain integer are bytes."""
    s = v.strip()
    units = {"gib": 1 << 30, "gb": 10**9, "mib": 1 << 20, "mb": 10**6, "kib": 1 << 10}
    for u, m in units.items():
        if s.lower().endswith(u):
            return int(float(s[: -len(u)]) * m)
    if "." in s:
        return float(s)
    return int(s)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF folder (config.json + safetensors) or .gguf file; default: bundled SmolLM2-135M-Instruct")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="auto = bfloat16 where the CPU has bf16 instructions, else float32")
    g.add_argument("--seed", type=int, default=0, help="engine seed for unseeded random sampling")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=8192, help="most tokens in one prefill batch")
    g.add_argument("--max-model-len", type=int, default=None, help="prompt + output limit (default: the model's)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (PagedAttention)")
    g.add_argument("--kv-cache-memory", type=_memory, default=None,
                   help="KV cache budget: bytes (e.g. 2GiB) or a fraction of available memory (e.g. 0.3); "
                        "default min(4 GiB, 40%%)")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="exact number of KV blocks (overrides the budget)")
    g.add_argument("--scheduler", default="separate", choices=["separate"],
                   help="batching policy: separate = prefill and decode batches never mixed, prefill first")
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")


def engine_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    return dict(model=a.model, dtype=a.dtype, seed=a.seed, max_num_seqs=a.max_num_seqs,
                max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=a.max_model_len,
                block_size=a.block_size, kv_cache_memory=a.kv_cache_memory, num_kv_blocks=a.num_kv_blocks,
                scheduler=a.scheduler, num_threads=a.threads)


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="most output tokens per request")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1, help="-1 disables")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed (reproducible sampling)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating after EOS up to --max-tokens")


def sampling_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    return dict(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p,
                repetition_penalty=a.repetition_penalty, presence_penalty=a.presence_penalty,
                frequency_penalty=a.frequency_penalty, seed=a.sampling_seed, stop=a.stop, ignore_eos=a.ignore_eos)
