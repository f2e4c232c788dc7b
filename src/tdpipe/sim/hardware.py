"""Devices the simulator knows: peak compute, memory bandwidth and size, and the links between devices.

GPU rows are datasheet peaks (dense FP16/BF16 tensor core, HBM bandwidth); L20 and A100-80G are TD-Pipe's
Table 1 verbatim, including the measured all-reduce bandwidth of their PCIe-switch nodes (§4.1). Achieved
fractions of the peaks (`flops_eff`, `bw_eff`, `attn_eff`) and the fixed overheads are assumptions of the
cost model, the same for every GPU; they are stated with the fields (sim/device.py) and in
docs/simulator.md rather than tuned to the paper's figures. The local CPU is measured instead
(sim/calibrate.py): `cpu` loads or makes that calibration. Any row can be replaced by a JSON file with the
same fields (`--hardware FILE`).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from tdpipe.sim.device import GB, TFLOPS, Hardware

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
