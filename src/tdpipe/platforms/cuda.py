"""The CUDA platform: stages on NVIDIA GPUs, NCCL between GPUs, the Triton paged-attention kernels, bf16.

Run on a GPU: `tdpipe gpu-check` passed on an NVIDIA H200 (docs/gpu.md, "Results"); the unit tests inject the
probes so they run without one.

Memory: `--gpu-memory-utilization` means what it means in vLLM: the share of the device's *total* memory
this process may end up using, weights, KV cache and everything already allocated on it included. The KV
cache gets what is left of that share:

    kv_bytes = gpu_memory_utilization * total - (total - free) - weights_bytes

with (free, total) from torch.cuda.mem_get_info after this process's unreferenced tensors are collected and
torch's cached blocks handed back (so a second LLM in one process sees what the first one freed), read
before the weights load (the engine sizes the cache before the stages start) and `weights_bytes` what they
will take. Memory other processes hold counts as
used, as in vLLM. Activations, the sampler's [batch, vocab] tensors and CUDA-graph pools are not measured
(vLLM profiles a forward pass for them): the (1 - utilization) margin must cover them.
"""
from __future__ import annotations

import gc
import os
from collections.abc import Callable

import torch

from tdpipe.malloc import pin_mmap_threshold
from tdpipe.platforms.interface import KvRequest, Platform

ALLOC_CONF = "expandable_segments:True"  # fewer fragments as KV cache and activations come and go
MemInfo = Callable[[int], tuple[int, int]]  # device index -> (free, total) bytes, torch.cuda.mem_get_info


def cuda_kv_bytes(requested: KvRequest, gpu_memory_utilization: float, weights_bytes: int,
                  free: int, total: int) -> int:
    """The arithmetic of CudaPlatform.kv_cache_bytes (module docstring). `requested` in bytes wins as given;
    a fraction is of the memory left free once the weights are in. Raises ValueError when nothing is left."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    after_weights = free - weights_bytes
    if isinstance(requested, int) and not isinstance(requested, bool):
        return requested
    if isinstance(requested, float):
        budget = int(requested * after_weights)
    else:
        budget = int(gpu_memory_utilization * total) - (total - free) - weights_bytes
    if budget <= 0:
        gib = 1 << 30
        raise ValueError(
            f"no GPU memory left for the KV cache: {gpu_memory_utilization:.2f} x {total / gib:.1f} GiB total, "
            f"{(total - free) / gib:.1f} GiB already in use, {weights_bytes / gib:.1f} GiB of weights; "
            "raise --gpu-memory-utilization or free the device")
    return budget


class CudaPlatform(Platform):
    name = "cuda"
    dist_backend = "nccl"
    attention_backend = "triton"
    supports_cuda_graphs = True
    host_memory = False

    def __init__(self, mem_get_info: MemInfo | None = None, device_count: Callable[[], int] | None = None) -> None:
        """`mem_get_info` and `device_count`: the probes, injectable so tests run without a GPU."""
        self._mem_get_info = mem_get_info
        self._device_count = device_count

    def device_count(self) -> int:
        return (self._device_count or torch.cuda.device_count)()

    def mem_get_info(self, index: int = 0) -> tuple[int, int]:
        if self._mem_get_info is not None:
            return self._mem_get_info(index)
        gc.collect()  # an LLM shut down earlier in this process: its weights and KV cache are garbage by now
        self.empty_cache()  # ... but torch's allocator keeps their blocks cached, counted as used
        return torch.cuda.mem_get_info(index)

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def device_index(self, local_rank: int = 0) -> int:
        """Worker `local_rank` (stage i with T = 1) runs on GPU local_rank % device_count: with fewer GPUs
        than workers, several share one (pp = 2 on one GPU)."""
        n = self.device_count()
        if n < 1:
            raise RuntimeError("CUDA reports no devices")
        return local_rank % n

    def torch_device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cuda", self.device_index(local_rank))

    def set_device(self, local_rank: int = 0) -> torch.device:
        dev = self.torch_device(local_rank)
        torch.cuda.set_device(dev)
        return dev

    def configure_process(self, threads: int | None) -> None:
        """The allocator setting only takes effect before CUDA's first allocation in this process: a value the
        user set is kept. The host heap is pinned as on CPU: the engine still builds per-step host tensors
        (sampling on the host, staged activations; tdpipe/malloc.py)."""
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)
        pin_mmap_threshold()
        if threads is not None:  # host-side work (input preparation, sampling on the host) still uses them
            torch.set_num_threads(threads)

    def kv_cache_bytes(self, requested: KvRequest, gpu_memory_utilization: float, weights_bytes: int,
                       index: int = 0) -> int:
        free, total = self.mem_get_info(index)
        return cuda_kv_bytes(requested, gpu_memory_utilization, weights_bytes, free, total)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


__all__ = ["ALLOC_CONF", "CudaPlatform", "cuda_kv_bytes"]
