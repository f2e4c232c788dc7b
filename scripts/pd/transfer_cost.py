"""Time the disaggregated KV transfer's two copies (worker/kv_transfer.py) on one core: a 512-token prompt of the
bundled model (32 blocks of SmolLM2-135M's KV) exported from a KV cache into the shared staging area and imported
into another cache, in bf16 and float32.

    python scripts/pd/transfer_cost.py
"""
import time, torch, os
from tdpipe.worker.kv_transfer import create_staging_file, map_staging, staging_shape, export_blocks, import_blocks
torch.set_num_threads(1)
L, H, BS, D = 30, 3, 16, 64   # SmolLM2-135M's KV shape
for dtype in (torch.bfloat16, torch.float32):
    cache = torch.randn(L, 2, 2048, H, BS, D).to(dtype)
    shape = staging_shape(256, L, H, BS, D)
    path = "/dev/shm/tdpipe-xfer-test"
    create_staging_file(path, shape, dtype); st = map_staging(path, shape, dtype); os.unlink(path)
    pairs = [(b, s) for s, b in enumerate(range(100, 132))]  # 32 blocks = a 512-token prompt
    for _ in range(3): export_blocks(cache, st, pairs); import_blocks(cache, st, [(s, b + 1000) for b, s in pairs])
    t = time.perf_counter(); n = 20
    for _ in range(n): export_blocks(cache, st, pairs)
    te = (time.perf_counter() - t) / n
    t = time.perf_counter()
    for _ in range(n): import_blocks(cache, st, [(s, b + 1000) for b, s in pairs])
    ti = (time.perf_counter() - t) / n
    mb = cache[:, :, :32].numel() * cache.element_size() / 1e6
    print(f"{dtype}: 32 blocks ({mb:.1f} MB): export {te*1e3:.2f} ms, import {ti*1e3:.2f} ms, {mb/te/1e3:.2f} GB/s out")
