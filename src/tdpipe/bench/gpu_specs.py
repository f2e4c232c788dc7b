"""Published figures of the GPUs tdpipe is measured and simulated on: datasheet peaks and the fractions of
those peaks that published measurements reached. Declared once, here, with their sources: the simulator's
GPU rows (sim/hardware.py) are built from them, and gpu-check's roofline divides by the datasheet bandwidth.

Peaks (dense: without 2:4 sparsity, which datasheets often quote):
  H100 SXM5 80GB: 989.4 BF16 TFLOP/s, 3.35 TB/s HBM3, NVLink4 900 GB/s per GPU (450 each way).
    https://www.nvidia.com/en-us/data-center/h100/ ; the dense figure derived per clock in
    https://glennklockwood.com/garden/processors/h100 (528 tensor cores x 1024 FLOP/clock x 1.83 GHz)
  H200 141GB: the H100's compute, 4.8 TB/s HBM3e. https://www.nvidia.com/en-us/data-center/h200/
  A100: 312 BF16 TFLOP/s; 40GB 1555 GB/s, 80GB SXM4 2039 GB/s, 80GB PCIe 1935 GB/s; NVLink3 600 GB/s.
    https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf

Achieved fractions (ceilings measured by micro-benchmarks and papers' kernels, not by tdpipe's kernels):
  GEMM: Maximum Achievable Matmul FLOPS, bf16, best shape, mean of 100 iterations (S. Bekman, ml-engineering,
    "Maximum Achievable Matmul FLOPS comparison table", v2:
    https://github.com/stas00/ml-engineering/tree/master/compute/accelerator#maximum-achievable-matmul-flops-comparison-table):
    H100 SXM 794.5 of 989 (torch 2.7.0+cu126), A100 SXM 271.2 of 312, A100 PCIe 252.9 of 312. The H100
    figure was also seen on the machines gpu-check targets: an 8192^3 bf16 product at 769-798 TFLOP/s on an
    H100 80GB HBM3 and 788 on an H200 (torch 2.11.0+cu130).
  Memory: the best a copy or read kernel reaches. H100 80GB HBM3: a device-to-device copy at ~3.0 TB/s
    counting bytes read and written, of 3.35; H200: ~4.3 of 4.8 (both with torch on those machines). A100 80GB
    SXM: a read kernel at 1.80 of 2.04 TB/s, Nsight Compute agreeing (88%), and no kernel above ~90% per the
    GTC talk cited there: https://forums.developer.nvidia.com/t/trouble-to-reach-peak-bandwidth-of-a100/339083
    (the A100 PCIe cards are given the same fraction: the same HBM2e stacks and memory controllers).
  Attention (prefill): FlashAttention-2 reaches 50-73% of the A100's peak forward (Dao 2023, arXiv:2307.08691,
    abstract; the low end: short varlen sequences) and 35% of the H100's (Shah et al. 2024, FlashAttention-3,
    arXiv:2407.08608, abstract; FA3 itself 75%). tdpipe's Triton kernels are FlashAttention-2-like.
"""
from __future__ import annotations

from dataclasses import dataclass

TFLOPS = 1e12
GB = 1e9


@dataclass(frozen=True)
class GpuSpec:
    """One card: datasheet peaks and the published achieved fractions of them."""

    name: str
    bf16_flops: float  # dense FLOP/s
    mem_bw: float  # bytes/s
    memory: float  # bytes
    gemm_eff: float
    bw_eff: float
    attn_eff: float


H100_GEMM_EFF = 794.5 / 989
A100_SXM_GEMM_EFF = 271.2 / 312
A100_PCIE_GEMM_EFF = 252.9 / 312
H100_BW_EFF = 3.0 / 3.35
H200_BW_EFF = 4.3 / 4.8
A100_BW_EFF = 1.80 / 2.04
A100_ATTN_EFF = 0.50
H100_ATTN_EFF = 0.35

SPECS: dict[str, GpuSpec] = {s.name: s for s in (
    GpuSpec("h100-sxm5-80g", 989.4 * TFLOPS, 3350 * GB, 80 * GB, H100_GEMM_EFF, H100_BW_EFF, H100_ATTN_EFF),
    GpuSpec("h200-141g", 989.4 * TFLOPS, 4800 * GB, 141 * GB, H100_GEMM_EFF, H200_BW_EFF, H100_ATTN_EFF),
    GpuSpec("a100-sxm4-80g", 312 * TFLOPS, 2039 * GB, 80 * GB, A100_SXM_GEMM_EFF, A100_BW_EFF, A100_ATTN_EFF),
    GpuSpec("a100-pcie-80g", 312 * TFLOPS, 1935 * GB, 80 * GB, A100_PCIE_GEMM_EFF, A100_BW_EFF, A100_ATTN_EFF),
    GpuSpec("a100-40g", 312 * TFLOPS, 1555 * GB, 40 * GB, A100_PCIE_GEMM_EFF, A100_BW_EFF, A100_ATTN_EFF),
)}


def match_gpu(name: str | None, memory_bytes: float | None = None) -> str | None:
    """The SPECS key of a GPU as torch names it ("NVIDIA H100 80GB HBM3" -> h100-sxm5-80g), None for a card
    not listed. The H100 NVL and H100 PCIe are other products (other clocks and memory): not listed."""
    n = (name or "").upper()
    if "H200" in n:
        return "h200-141g"
    if "H100" in n:
        return None if "NVL" in n or "PCIE" in n else "h100-sxm5-80g"
    if "A100" in n:
        if "40GB" in n or memory_bytes is not None and memory_bytes < 60e9:
            return "a100-40g"
        return "a100-sxm4-80g" if "SXM" in n else "a100-pcie-80g"
    return None


__all__ = ["GB", "SPECS", "TFLOPS", "GpuSpec", "match_gpu"]
