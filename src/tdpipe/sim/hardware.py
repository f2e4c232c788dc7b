"""Devices the simulator knows: peak compute, memory bandwidth and size, and the links between devices.

GPU rows are datasheet peaks (dense FP16/BF16 tensor core, HBM bandwidth); L20 and A100-80G are TD-Pipe's
Table 1 verbatim, including the measured all-reduce bandwidth of their PCIe-switch nodes (§4.1). Achieved
fractions of the peaks (`flops_eff`, `bw_eff`, `attn_eff`) and the fixed overheads are assumptions of the
cost model, the same for every GPU; they are stated here and in docs/simulator.md rather than tuned to the
paper's figures. The local CPU is measured instead (sim/calibrate.py): `cpu` loads or makes that
calibration. Any row can be replaced by a JSON file with the same fields (`--hardware FILE`).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

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


# PCIe Gen4 x16 is ~25 GB/s one way on paper; TD-Pipe measured 14.65 / 14.82 GB/s all-reduce on its PCIe
# switch nodes. Stage-to-stage sends are assumed to reach the same figure (they are small either way).
PCIE4_AR = 14.82 * GB
PCIE5_AR = 2 * PCIE4_AR  # assumption: a Gen5 switch doubles the Gen4 node's all-reduce bandwidth
NVLINK4_AR = 360 * GB  # assumption: NCCL all-reduce bus bandwidth inside an 8x H100 NVLink4 node (of 450 per way)
CX7_NIC = 50 * GB  # 400 Gbps

TABLE: dict[str, Hardware] = {
    "l20": Hardware("l20", 119.5 * TFLOPS, 864 * GB, 48 * GB, 14.65 * GB, 14.65 * GB,
                    source="TD-Pipe Table 1 (4x L20 48GB, PCIe switch)"),
    "a100-80g": Hardware("a100-80g", 312 * TFLOPS, 1935 * GB, 80 * GB, PCIE4_AR, PCIE4_AR,
                         source="TD-Pipe Table 1 (4x A100 80GB PCIe, PCIe switch)"),
    "a100-40g": Hardware("a100-40g", 312 * TFLOPS, 1555 * GB, 40 * GB, PCIE4_AR, PCIE4_AR,
                         source="NVIDIA A100 40GB datasheet; PCIe Gen4 links as TD-Pipe's A100 node"),
    "h100": Hardware("h100", 989.4 * TFLOPS, 3350 * GB, 80 * GB, PCIE5_AR, PCIE5_AR,
                     source="NVIDIA H100 SXM5 80GB datasheet (dense BF16); PCIe Gen5 links assumed, no NVLink"),
    "h100-nvl": Hardware("h100-nvl", 989.4 * TFLOPS, 3350 * GB, 80 * GB, NVLINK4_AR, NVLINK4_AR, node_size=8,
                         internode_bw=CX7_NIC,
                         source="SiPipe §7.1 H100-NVL testbed: 8x H100 SXM5 80GB per node over NVLink, nodes over "
                                "400 Gbps ConnectX-7 NICs (one per GPU assumed); all-reduce bus bandwidth assumed"),
    "h200": Hardware("h200", 989.4 * TFLOPS, 4800 * GB, 141 * GB, PCIE5_AR, PCIE5_AR,
                     source="NVIDIA H200 141GB datasheet (dense BF16); PCIe Gen5 links assumed, no NVLink"),
}

NAMES = sorted(TABLE) + ["cpu"]


def load_hardware(spec: str, threads: int | None = None, recalibrate: bool = False) -> Hardware:
    """A table name, 'cpu' (this machine, calibrated once and cached; `threads` per device), or a JSON file."""
    key = spec.lower()
    if key in TABLE:
        return TABLE[key]
    if key == "cpu":
        from tdpipe.sim.calibrate import cpu_hardware

        return cpu_hardware(threads, recalibrate=recalibrate)
    path = Path(spec)
    if spec.lower().endswith(".json") and not path.is_file():
        raise ValueError(f"hardware file {spec}: " + ("is a directory" if path.is_dir() else "no such file"))
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except (ValueError, OSError) as e:  # UnicodeDecodeError is a ValueError
            raise ValueError(f"hardware file {spec}: not valid JSON: {' '.join(str(e).split())}") from None
        if isinstance(data, dict) and "devices" in data:  # a calibration file: one row per thread count
            from tdpipe.sim.calibrate import pick_threads

            return pick_threads(data, threads)
        return Hardware.from_json(data)
    raise ValueError(f"unknown hardware {spec!r}: expected one of {NAMES} or a JSON file with the fields of "
                     "tdpipe.sim.hardware.Hardware")


def with_links(hw: Hardware, allreduce_bw: float | None = None, link_bw: float | None = None) -> Hardware:
    """The same device on a different interconnect (e.g. NVLink: --allreduce-bw 300)."""
    return replace(hw, allreduce_bw=allreduce_bw or hw.allreduce_bw, link_bw=link_bw or hw.link_bw)


__all__ = ["GB", "Hardware", "NAMES", "TABLE", "TFLOPS", "load_hardware", "with_links"]
