"""Achievable matmul peak of this machine: the denominator of MFU.

A datasheet peak is unknown for most CPUs (and turbo/AVX-512 clocks vary with load), so MFU is reported
against what torch's own GEMM reaches on the same thread count and dtype: "how much of what the hardware
demonstrably does are we using".
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import torch


def measure_matmul_peak(dtype: torch.dtype = torch.bfloat16, n: int = 2048, seconds: float = 1.0) -> float:
    """GFLOP/s of square n x n matmuls on the current torch thread count: best of several timed repetitions
    after a warm-up, each repetition running back-to-back matmuls for about seconds / 5."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(dtype)
    b = torch.randn(n, n, generator=g).to(dtype)
    c = torch.empty(n, n, dtype=dtype)
    flops = 2.0 * n ** 3
    torch.mm(a, b, out=c)  # warm-up: page in buffers, let the library pick its kernel
    t0 = time.perf_counter()
    torch.mm(a, b, out=c)
    one = max(time.perf_counter() - t0, 1e-6)
    reps = 5
    iters = max(1, int(seconds / reps / one))
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            torch.mm(a, b, out=c)
        dt = time.perf_counter() - t0
        best = max(best, flops * iters / dt)
    return best / 1e9


def measure_matmul_peak_fresh(dtype: torch.dtype, threads: int) -> float:
    """measure_matmul_peak in a new Python process with `threads` threads. The bench's own process is not a
    clean place for it once an engine with worker processes exists: there a 2-thread matmul measured 737
    GFLOP/s against 2394 before the engine started and 2711 in a pp = 1 engine (Xeon with AMX, 2 cores),
    which made pp > 1 rows' MFU three times too high."""
    code = ("import sys, torch\nfrom tdpipe.bench.peak import measure_matmul_peak\n"
            f"torch.set_num_threads({int(threads)})\n"
            f"print(measure_matmul_peak(getattr(torch, {str(dtype).removeprefix('torch.')!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": str(int(threads))})
    return float(out.stdout.strip().splitlines()[-1])
