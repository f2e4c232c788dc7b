"""A GPU row re-calibrated from what `tdpipe gpu-check` measured, in place of the published fractions.

From the check's environment step: flops_eff = the measured bf16 GEMM rate / the datasheet peak, bw_eff = the
measured device-to-device copy rate (bytes read + written) / the datasheet bandwidth, memory = the card's.
From its large-model throughput step (the real engine's decode steps at the largest batch): the time those
steps take beyond the roofline of the calibrated row becomes the fixed cost per step, charged per layer
(layer_overhead = median excess / layers; one model cannot separate a per-layer from a per-step cost, as
sim/calibrate.py's CPU fit notes). attn_eff keeps the base row's published figure: decode steps read KV,
they do not measure prefill attention's FLOP rate.
"""
from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any

from tdpipe.sim.cost import CostModel, StepShape
from tdpipe.sim.device import Hardware


def _fraction(measured: Any, peak: float, what: str) -> float:
    if not isinstance(measured, (int, float)) or isinstance(measured, bool) or not measured > 0:
        raise ValueError(f"the gpu-check JSON has no measured {what}")
    return min(1.0, float(measured) / peak)


def decode_overhead(row: Hardware, hf_config: dict[str, Any], points: list[list[float]]) -> float | None:
    """Median seconds per decode step beyond `row`'s roofline (no fixed costs), over the recorded steps
    [[sequences, context tokens, seconds], ...]; None without points."""
    from tdpipe.config import ModelConfig

    if not points:
        return None
    mc = ModelConfig.from_hf(hf_config)
    cm = CostModel(mc, replace(row, layer_overhead=0.0, step_overhead=0.0, slowdown=1.0), [(0, mc.num_layers)])
    excess = [s - cm.stage_times(StepShape(int(d), int(d), float(c), int(c)))[0] for d, c, s in points]
    return max(0.0, statistics.median(excess))


def calibrated_row(doc: dict[str, Any], base: Hardware) -> Hardware:
    """`base` (the card's datasheet row) with the fractions and fixed cost the check measured."""
    env = doc.get("environment") or {}
    row = replace(base, name=f"{base.name}-measured",
                  flops_eff=_fraction(env.get("matmul_bf16_tflops"), base.flops / 1e12, "bf16 GEMM rate"),
                  bw_eff=_fraction(env.get("copy_bytes_per_s"), base.mem_bw, "copy bandwidth"),
                  memory=float(env.get("gpu_memory_bytes") or base.memory))
    step = (doc.get("steps") or {}).get("throughput_8b") or {}
    engine = step.get("engine") or {}
    extra = ""
    per_step = decode_overhead(row, engine.get("model_config") or {}, engine.get("decode_points") or [])
    if per_step is not None:
        layers = int(engine["model_config"]["num_hidden_layers"])
        row = replace(row, layer_overhead=per_step / layers, step_overhead=0.0)
        extra = (f"; fixed cost {1e3 * per_step:.2f} ms per decode step beyond the roofline over "
                 f"{len(engine['decode_points'])} engine steps of {engine.get('model', 'the large model')}")
    who = ", ".join(f"{k} {env[k]}" for k in ("gpu", "driver", "torch", "triton") if env.get(k))
    return replace(row, source=f"tdpipe gpu-check {doc.get('finished', '')} on {who}: bf16 GEMM "
                               f"{env['matmul_bf16_tflops']:.0f} TFLOP/s, copy {env['copy_bytes_per_s'] / 1e9:.0f} "
                               f"GB/s{extra}; peaks and attn_eff: {base.source}")


__all__ = ["calibrated_row", "decode_overhead"]
