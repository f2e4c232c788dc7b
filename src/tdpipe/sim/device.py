"""One device kind as the simulator prices it: peak compute, memory bandwidth and size, the links between
devices, and the fractions of those peaks a real run reaches: published measurements for the A100 / H100 /
H200 rows (bench/gpu_specs.py), assumed for the L20, measured for this CPU (docs/simulator.md). The devices
the simulator knows, and the local CPU's measured row, are in sim/hardware.py and sim/calibrate.py.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

GB = 1e9
TFLOPS = 1e12


@dataclass(frozen=True)
class Hardware:
    """One device kind. Bandwidths in bytes/s, memory in bytes, times in seconds."""

    name: str
    flops: float  # peak dense FP16/BF16 FLOP/s of one device
    mem_bw: float  # memory bandwidth of one device
    memory: float  # memory of one device
    allreduce_bw: float  # all-reduce bus bandwidth between the devices of a node (tensor parallelism)
    link_bw: float  # point-to-point bandwidth between neighbouring pipeline stages
    link_latency: float = 10e-6  # per activation transfer
    allreduce_latency: float = 20e-6  # per all-reduce
    flops_eff: float = 0.70  # achieved fraction of `flops` on the linear layers' GEMMs
    bw_eff: float = 0.80  # achieved fraction of `mem_bw` streaming weights and KV
    attn_eff: float = 0.50  # achieved fraction of `flops` in attention (prefill: FlashAttention-like)
    layer_overhead: float = 40e-6  # per decoder layer per micro-batch: kernel launches, norms, rotary
    step_overhead: float = 1e-3  # per stage per micro-batch: input preparation not hidden by the runtime
    engine_step: float = 1e-3  # engine per micro-batch: schedule, bookkeeping (serial with a pp=1 step)
    engine_row: float = 5e-6  # engine per sequence in a micro-batch: sampling, stop checks
    mem_util: float = 0.90  # usable fraction of memory (vLLM's gpu_memory_utilization)
    reserve: float = 1.5 * GB  # per device: activations, CUDA context, sampler buffers
    slowdown: float = 1.0  # stage compute time in a running pipeline / the same step timed alone (CPU rows:
    # stages, their helper threads and the engine share the cores; measured by sim/calibrate.py)
    threads: int = 0  # CPU rows: compute threads of one device; 0 for GPUs
    node_size: int = 0  # devices per node (0: every device in one node); beyond it links are internode_bw
    internode_bw: float = 0.0  # per device between nodes (NIC): all-reduces of a TP group spanning nodes,
    # stage-to-stage sends that cross a node boundary
    measured_engine: bool = False  # charge the engine's real Python time (CPU rows) instead of engine_*
    source: str = ""

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Hardware":
        if not isinstance(data, dict):
            raise ValueError(f"hardware JSON must be an object of Hardware's fields, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown hardware field(s) {unknown}; known: {sorted(known)}")
        missing = [f for f in ("name", "flops", "mem_bw", "memory", "allreduce_bw", "link_bw") if f not in data]
        if missing:
            raise ValueError(f"hardware JSON misses field(s) {missing}")
        for f in fields(cls):  # a string or inf here would surface as a TypeError or an infinite throughput
            v = data.get(f.name)
            if f.name in data and f.type in ("float", "int") and not _finite_number(v):
                raise ValueError(f"hardware field {f.name} must be a finite number, got {v!r}")
            if f.name in data and f.type == "bool" and not isinstance(v, bool):
                raise ValueError(f"hardware field {f.name} must be true or false, got {v!r}")
            if f.name in data and f.type == "str" and not isinstance(v, str):
                raise ValueError(f"hardware field {f.name} must be a string, got {v!r}")
        hw = cls(**data)
        for f in ("flops", "mem_bw", "memory", "allreduce_bw", "link_bw"):
            if not getattr(hw, f) > 0:
                raise ValueError(f"hardware field {f} must be > 0, got {getattr(hw, f)!r}")
        if not hw.slowdown > 0:
            raise ValueError(f"hardware field slowdown must be > 0, got {hw.slowdown!r}")
        for f in ("flops_eff", "bw_eff", "attn_eff", "mem_util"):
            if not 0 < getattr(hw, f) <= 1:
                raise ValueError(f"hardware field {f} must be in (0, 1], got {getattr(hw, f)!r}")
        return hw


def _finite_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


__all__ = ["GB", "TFLOPS", "Hardware"]
