"""swiglu_quant per call, [rows, 2 x 1536] int32 (the bundled model's gate_up output), 2 threads: median of 5
timings of 100 calls. Run with PYTHONPATH=OLD/src for the old kernel (run.sh's worktree)."""
import statistics
import time

import torch

from tdpipe.model import cpu_ops

torch.set_num_threads(2)
k = cpu_ops.kernel()
g = torch.Generator().manual_seed(0)
for rows in (256, 2048):
    acc = torch.randint(-2 ** 16, 2 ** 16, (rows, 2 * 1536), generator=g, dtype=torch.int32)
    sx, sw = torch.rand(rows, generator=g) * 0.01 + 1e-3, torch.rand(2 * 1536, generator=g) * 1e-3
    for _ in range(10):
        k.swiglu_quant(acc, sx, sw)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(100):
            k.swiglu_quant(acc, sx, sw)
        times.append((time.perf_counter() - t) / 100 * 1e6)
    print(f"rows {rows}: {statistics.median(times):.0f} us per call")
