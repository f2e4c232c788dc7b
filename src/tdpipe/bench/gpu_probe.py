"""What a GPU check ran on, and the two peaks the simulator is calibrated against.

environment(): GPU name, driver, memory, multiprocessors, compute capability, and the versions of Python,
torch (and its CUDA), triton and transformers, so every figure can be traced to its machine.
matmul_tflops(): a square bf16 GEMM, the mean of timed repetitions after warm-ups (the same measurement this
workplace recorded on its H100: 8192^3 at 769-798 TFLOP/s); copy_bandwidth(): a device-to-device copy,
counting the bytes read and written. On a CPU (the dry run) the same code runs at tiny sizes.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import time
from typing import Any

import torch


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvidia_smi() -> dict[str, str]:
    """Driver and name as nvidia-smi reports them ({} where it is missing or fails)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    try:
        out = subprocess.run([exe, "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    line = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    parts = [p.strip() for p in line.split(",")]
    keys = ("smi_name", "driver", "smi_memory", "max_sm_clock")
    return dict(zip(keys, parts)) if len(parts) == len(keys) else {}


def _commit() -> str | None:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        out = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def environment(device: str) -> dict[str, Any]:
    """The machine and software of this check."""
    from tdpipe.version import __version__

    env: dict[str, Any] = {
        "device": device, "python": sys.version.split()[0], "platform": platform.platform(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "triton": _version("triton"),
        "transformers": _version("transformers"), "tdpipe": __version__, "commit": _commit(),
        "cpu_count": os.cpu_count(),
    }
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        env |= {"gpu": p.name, "gpu_memory_bytes": p.total_memory, "multiprocessors": p.multi_processor_count,
                "compute_capability": f"{p.major}.{p.minor}", "gpu_count": torch.cuda.device_count(),
                "cuda_runtime": torch.version.cuda, **_nvidia_smi()}
    else:
        from tdpipe.config import cpu_name

        env |= {"gpu": None, "cpu": cpu_name()}
    return env


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Any, device: str, warmup: int, iters: int) -> float:
    """Mean seconds of `fn` over `iters` calls after `warmup` calls, timed around the whole loop."""
    for _ in range(warmup):
        fn()
    _sync(device)
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - t) / iters


def matmul_tflops(device: str, n: int, dtype: torch.dtype = torch.bfloat16, iters: int = 10) -> float:
    """TFLOP/s of an n x n x n GEMM on random data (random, not zeros: zeros ran 13% faster on the H200)."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    c = torch.empty(n, n, device=device, dtype=dtype)
    s = _timed(lambda: torch.mm(a, b, out=c), device, 3, iters)
    return 2.0 * n ** 3 / s / 1e12


def copy_bandwidth(device: str, nbytes: int, iters: int = 10) -> float:
    """Bytes/s of a device-to-device copy of `nbytes`, counting what is read and what is written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    s = _timed(lambda: dst.copy_(src), device, 3, iters)
    return 2.0 * nbytes / s


__all__ = ["copy_bandwidth", "environment", "matmul_tflops"]
