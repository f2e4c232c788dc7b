"""Decode roofline: the share of the device's memory bandwidth a decode step turns into useful bytes.

A decode step of a large batch reads every weight once (the decoder layers, the final norm and the lm_head;
the embedding only gathers one row per sequence, left out) and the whole KV context of every sequence, and
writes one new K/V entry per sequence per layer. At batch 256 on an 8B model in bf16 that is ~15 GB of
weights plus the KV, against ~0.5 TFLOP: memory-bound on every current GPU, so bytes / step time over the
memory bandwidth is the step's distance from the roofline (the bar: >= 50% of the datasheet bandwidth).
"""
from __future__ import annotations

import statistics
from typing import Any

from tdpipe.config import ModelConfig


def decode_weight_bytes(mc: ModelConfig, dtype_bytes: int = 2) -> int:
    """Weights one decode step reads: the layers' linears and norms, the final norm and the lm_head (the
    embedding when tied, as the head). Qwen2's q/k/v biases (under 0.01% of the bytes) are left out."""
    linears = mc.params_per_token_flops() // 2  # 2 FLOPs per weight per token
    norms = mc.hidden_size * (2 * mc.num_layers + 1)
    return dtype_bytes * (linears + norms + mc.vocab_size * mc.hidden_size)


def decode_step_bytes(mc: ModelConfig, batch: int, context_tokens: int, dtype_bytes: int = 2) -> int:
    """Bytes of one decode step of `batch` sequences holding `context_tokens` of KV in all (after the step)."""
    kv = mc.kv_bytes_per_token(dtype_bytes)
    return decode_weight_bytes(mc, dtype_bytes) + context_tokens * kv + batch * kv  # reads + the new entries


def last_stage_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """The micro-batches of the last pipeline stage (pp = 1: the only one) of a tdpipe trace."""
    stages = trace.get("stages") or []
    return stages[-1]["events"] if stages else []


def decode_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Pure decode micro-batches of the last pipeline stage of a tdpipe trace."""
    return [e for e in last_stage_events(trace) if e.get("decode_seqs") and not e.get("prefill_tokens")]


def roofline(mc: ModelConfig, events: list[dict[str, Any]], bandwidth: float, dtype_bytes: int = 2,
             batch: int | None = None) -> dict[str, Any]:
    """Median roofline fraction over the decode steps of the largest batch seen (or of `batch`): bytes per
    step / step seconds / `bandwidth` (bytes/s). A step's time is its trace interval (start to end)."""
    if not events:
        raise ValueError("no decode steps in the trace: the roofline needs a traced run (collect_trace=True)")
    size = batch or max(e["decode_seqs"] for e in events)
    steps = [e for e in events if e["decode_seqs"] == size and e["end"] > e["start"]]
    if not steps:
        raise ValueError(f"no decode step of batch {size} in the trace")
    fractions, seconds, nbytes = [], [], []
    for e in steps:
        b = decode_step_bytes(mc, size, int(e["context_tokens"]), dtype_bytes)
        s = e["end"] - e["start"]
        fractions.append(b / s / bandwidth)
        seconds.append(s)
        nbytes.append(b)
    return {"batch": size, "steps": len(steps), "median_step_ms": 1e3 * statistics.median(seconds),
            "median_step_bytes": statistics.median(nbytes), "weight_bytes": decode_weight_bytes(mc, dtype_bytes),
            "bandwidth_bytes_per_s": bandwidth, "fraction": statistics.median(fractions),
            "achieved_bytes_per_s": statistics.median(fractions) * bandwidth}


__all__ = ["decode_events", "decode_step_bytes", "decode_weight_bytes", "roofline"]
