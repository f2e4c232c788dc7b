# Times the element-wise kernels at 256 and 2,048 rows (SmolLM2 shapes); once per checkout (PYTHONPATH).
import time

import torch

from tdpipe.model import cpu_ops, int8_linear

k = cpu_ops.kernel()
torch.manual_seed(0)


def bench(name, fn, nbytes, it=300):
    for _ in range(20):
        fn()
    t = time.perf_counter()
    for _ in range(it):
        fn()
    dt = (time.perf_counter() - t) / it
    print(f"{name:40s} {dt*1e6:8.1f} us  {nbytes/dt/1e9:6.1f} GB/s")


for M in (256, 2048):
    x, r = torch.randn(M, 576, dtype=torch.bfloat16), torch.randn(M, 576, dtype=torch.bfloat16)
    w = torch.randn(576, dtype=torch.bfloat16)
    bench(f"add_rms_norm M={M}", lambda: cpu_ops.add_rms_norm(x, r, w, 1e-5), M * 576 * 2 * 4)
    bench(f"quantize_rows M={M}", lambda: int8_linear.quantize_rows(x), M * 576 * 3)
    acc = torch.randint(-10000, 10000, (M, 960), dtype=torch.int32)
    sx, sw = torch.rand(M) * 1e-3, torch.rand(960)
    bench(f"dequant_rows 960 M={M}", lambda: int8_linear.dequant_rows(acc, sx, sw, None, torch.bfloat16),
          M * 960 * 6)
    acc2, sw2 = torch.randint(-10000, 10000, (M, 3072), dtype=torch.int32), torch.rand(3072) * 0.3
    bench(f"swiglu_quant M={M}", lambda: k.swiglu_quant(acc2, sx, sw2), M * 3072 * 4 + M * 1536)
    q, pos = torch.randn(M, 15, 64, dtype=torch.bfloat16), torch.randint(0, 300, (M,))
    cs = torch.randn(2048, 64)
    bench(f"rope q+k M={M}", lambda: cpu_ops.rope_(q, pos, cs), M * 15 * 64 * 4)
