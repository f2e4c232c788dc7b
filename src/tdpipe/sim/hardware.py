"""Devices the simulator knows: peak compute, memory bandwidth and size, the links between devices, and the
fractions of those peaks a real run reaches.

Peaks are datasheet figures (dense FP16/BF16 tensor core, HBM bandwidth, NVLink); L20 and A100-80G are TD-Pipe's
Table 1 verbatim, including the measured all-reduce bandwidth of their PCIe-switch nodes (§4.1). The achieved
fractions of the A100, H100 and H200 rows (`flops_eff`, `bw_eff`, `attn_eff`) come from published measurements,
each cited in bench/gpu_specs.py with the peaks; they are ceilings measured by micro-benchmarks and papers'
kernels, not by tdpipe's own kernels, which no GPU has run yet (docs/gpu.md). `tdpipe gpu-check calibrate FILE` (or
`--hardware FILE` with a gpu-check JSON) replaces them with what a GPU check measured (sim/gpu_calibrate.py).
The L20 row and the fixed overheads keep the cost model's stated assumptions (sim/device.py, docs/simulator.md).
The local CPU is measured instead (sim/calibrate.py): `cpu` loads or makes that calibration. Any row can be
replaced by a JSON file with the same fields (`--hardware FILE`).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from tdpipe.bench.gpu_check import SCHEMA as GPU_CHECK_SCHEMA
from tdpipe.bench.gpu_specs import SPECS, GpuSpec
from tdpipe.bench.gpu_specs import match_gpu as match_spec
from tdpipe.sim.device import GB, TFLOPS, Hardware

# PCIe Gen4 x16 is ~25 GB/s one way on paper; TD-Pipe measured 14.65 / 14.82 GB/s all-reduce on its PCIe
# switch nodes. Stage-to-stage sends are assumed to reach the same figure (they are small either way).
PCIE4_AR = 14.82 * GB
PCIE5_AR = 2 * PCIE4_AR  # assumption: a Gen5 switch doubles the Gen4 node's all-reduce bandwidth
# assumption: NCCL all-reduce bus bandwidth inside an 8x H100 NVLink4 node for the mid-size messages of decode
# (MBs). Published nccl-tests reference for large messages: 460-480 GB/s busbw on 8x H100 SXM5, 230-250 on
# 8x A100 SXM4 (https://docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests); NVLink4 is 900 GB/s per
# GPU both ways, 450 each way (H100 datasheet).
NVLINK4_AR = 360 * GB
NVLINK3_AR = 230 * GB  # the low end of the published 8x A100 SXM4 nccl-tests busbw above (NVLink3: 600 GB/s)
CX7_NIC = 50 * GB  # 400 Gbps

# Datasheet peaks and published achieved fractions, with their sources: bench/gpu_specs.py
_H100, _H200 = SPECS["h100-sxm5-80g"], SPECS["h200-141g"]
_A100_SXM, _A100_PCIE, _A100_40 = SPECS["a100-sxm4-80g"], SPECS["a100-pcie-80g"], SPECS["a100-40g"]
_EFF = "; efficiencies: published measurements (bench/gpu_specs.py)"


def _eff(spec: GpuSpec) -> dict[str, float]:
    return {"flops_eff": spec.gemm_eff, "bw_eff": spec.bw_eff, "attn_eff": spec.attn_eff}


TABLE: dict[str, Hardware] = {
    "l20": Hardware("l20", 119.5 * TFLOPS, 864 * GB, 48 * GB, 14.65 * GB, 14.65 * GB,
                    source="TD-Pipe Table 1 (4x L20 48GB, PCIe switch); efficiencies: the cost model's assumptions"),
    "a100-80g": Hardware("a100-80g", _A100_PCIE.bf16_flops, _A100_PCIE.mem_bw, 80 * GB, PCIE4_AR, PCIE4_AR,
                         **_eff(_A100_PCIE),
                         source="TD-Pipe Table 1 (4x A100 80GB PCIe, PCIe switch)" + _EFF),
    "a100-40g": Hardware("a100-40g", _A100_40.bf16_flops, _A100_40.mem_bw, 40 * GB, PCIE4_AR, PCIE4_AR,
                         **_eff(_A100_40),
                         source="NVIDIA A100 40GB datasheet; PCIe Gen4 links as TD-Pipe's A100 node" + _EFF),
    "a100-sxm4-80g": Hardware("a100-sxm4-80g", _A100_SXM.bf16_flops, _A100_SXM.mem_bw, 80 * GB, NVLINK3_AR,
                              NVLINK3_AR, **_eff(_A100_SXM), node_size=8,
                              source="NVIDIA A100 80GB SXM4 datasheet, 8 per node over NVLink3 (published "
                                     "nccl-tests all-reduce bandwidth)" + _EFF),
    "h100": Hardware("h100", _H100.bf16_flops, _H100.mem_bw, 80 * GB, PCIE5_AR, PCIE5_AR, **_eff(_H100),
                     source="NVIDIA H100 SXM5 80GB datasheet (dense BF16); PCIe Gen5 links assumed, no NVLink" + _EFF),
    "h100-nvl": Hardware("h100-nvl", _H100.bf16_flops, _H100.mem_bw, 80 * GB, NVLINK4_AR, NVLINK4_AR, node_size=8,
                         internode_bw=CX7_NIC, **_eff(_H100),
                         source="SiPipe §7.1 H100-NVL testbed: 8x H100 SXM5 80GB per node over NVLink, nodes over "
                                "400 Gbps ConnectX-7 NICs (one per GPU assumed); all-reduce bus bandwidth assumed"
                                + _EFF),
    "h200": Hardware("h200", _H200.bf16_flops, _H200.mem_bw, 141 * GB, PCIE5_AR, PCIE5_AR, **_eff(_H200),
                     source="NVIDIA H200 141GB datasheet (dense BF16); PCIe Gen5 links assumed, no NVLink" + _EFF),
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
        if isinstance(data, dict) and data.get("schema") == GPU_CHECK_SCHEMA:
            return from_gpu_check(data)
        return Hardware.from_json(data)
    raise ValueError(f"unknown hardware {spec!r}: expected one of {NAMES} or a JSON file with the fields of "
                     "tdpipe.sim.hardware.Hardware")


# the row of each listed card (bench/gpu_specs.py); the H100 SXM5's is the one without NVLink
SPEC_ROWS = {"h100-sxm5-80g": "h100", "h200-141g": "h200", "a100-sxm4-80g": "a100-sxm4-80g",
             "a100-pcie-80g": "a100-80g", "a100-40g": "a100-40g"}


def match_gpu(name: str | None, memory_bytes: float | None = None) -> str | None:
    """The TABLE row of a GPU as torch names it ("NVIDIA H100 80GB HBM3" -> h100), None for one not in it."""
    return SPEC_ROWS.get(match_spec(name, memory_bytes) or "")


def from_gpu_check(doc: dict, base: str | None = None) -> Hardware:
    """The row a `tdpipe gpu-check` JSON measured: its GPU's datasheet row (or `base`) with the measured
    fractions of the peaks (sim/gpu_calibrate.py)."""
    from tdpipe.sim.gpu_calibrate import calibrated_row

    env = doc.get("environment") or {}
    key = base or match_gpu(env.get("gpu"), env.get("gpu_memory_bytes"))
    if key is None or key not in TABLE:
        raise ValueError(f"gpu-check ran on {env.get('gpu') or 'no GPU'}, which has no datasheet row here; "
                         f"name one of {sorted(TABLE)} as the base (tdpipe gpu-check calibrate FILE --base NAME)")
    return calibrated_row(doc, TABLE[key])


def with_links(hw: Hardware, allreduce_bw: float | None = None, link_bw: float | None = None) -> Hardware:
    """The same device on a different interconnect (e.g. NVLink: --allreduce-bw 300)."""
    return replace(hw, allreduce_bw=allreduce_bw or hw.allreduce_bw, link_bw=link_bw or hw.link_bw)


__all__ = ["GB", "Hardware", "NAMES", "SPEC_ROWS", "TABLE", "TFLOPS", "from_gpu_check", "load_hardware", "match_gpu",
           "with_links"]
