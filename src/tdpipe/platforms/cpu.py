"""The CPU platform: stages as processes on this machine's cores, gloo between them, the C++ paged-attention
kernel (model/cpu_ops.py), bf16 where the CPU computes it natively.

The glibc settings live here because they are what the CPU allocator needs: a pinned mmap threshold in the
engine and the stages (tdpipe/malloc.py says why) and, in a process that holds the model, a heap that keeps
freed activation buffers (keep_freed_memory).
"""
from __future__ import annotations

import ctypes
import math
import mmap

import torch

from tdpipe.config import available_memory, cpu_supports_bf16, kv_budget
from tdpipe.malloc import pin_mmap_threshold, trim_heap
from tdpipe.platforms.interface import KvRequest, Platform


def keep_freed_memory() -> None:
    """glibc returns big freed buffers to the OS and page-faults them back on the next allocation (~0.4 ms
    per MB in this VM: more than the GEMM that fills them). Keep the heap instead (mallopt M_MMAP_MAX=0,
    M_TRIM_THRESHOLD=2 GiB); activations of one step are reused by the next."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-4, 0)
        libc.mallopt(-1, 0x7FFFFFFF)
    except (OSError, AttributeError):
        pass


class CpuPlatform(Platform):
    name = "cpu"
    dist_backend = "gloo"
    attention_backend = "cpu"
    supports_cuda_graphs = False
    host_memory = True

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16 if cpu_supports_bf16() else torch.float32

    def torch_device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu")

    def configure_process(self, threads: int | None) -> None:
        pin_mmap_threshold()  # per-step tensors of varying size must not fragment the heap (tdpipe/malloc.py)
        if threads is not None:
            torch.set_num_threads(threads)

    def configure_runner(self) -> None:
        keep_freed_memory()

    def empty_cache(self) -> None:
        """The heap keeps freed memory (keep_freed_memory): hand its free pages back (sleep)."""
        trim_heap()

    def kv_zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An anonymous mapping: the kernel hands out zeroed pages on first write, so only the blocks in use
        are ever resident and start-up does not wait for the whole cache to be written (torch.zeros: 0.85 s
        of every engine start here with the default 4 GiB). The first write of each page pays a fault
        instead (about 0.3 s per GiB written here, once per process). The mapping goes back to the OS when
        the tensor dies."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.zeros(shape, dtype=dtype, device=device)
        # private: a forked child must not share the parent's cache, and shared anonymous memory is tmpfs (its
        # faults cost 2.3x a private page's here)
        return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), dtype=dtype).view(shape)

    def kv_cache_bytes(self, requested: KvRequest, gpu_memory_utilization: float, weights_bytes: int) -> int:
        """As before the platforms existed: the weights are not subtracted (`available` is measured before
        they load, and the default's 40% leaves room for them); gpu_memory_utilization does not apply."""
        return kv_budget(requested, available_memory())


__all__ = ["CpuPlatform", "keep_freed_memory", "kv_budget"]
