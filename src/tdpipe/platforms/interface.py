"""What differs between devices, in one object per device: the engine asks the platform instead of asking
which device it is on (dtype default, threads, allocator settings, KV cache size, distributed backend,
attention backend, device index of a rank).

Keep every method importable and its arithmetic testable without the device: probes (free memory, device
count) are injected where a test needs to fake them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

KvRequest = int | float | None  # bytes, a fraction of available memory, or None: the platform's default


class Platform(ABC):
    """One device kind. Subclasses set the class attributes and implement the probes."""

    name: str  # "cpu" | "cuda": the torch device type
    dist_backend: str  # "gloo" | "nccl": the torch.distributed backend for tensors on this device
    attention_backend: str  # "cpu" (the C++ kernel, torch fallback) | "triton"
    supports_cuda_graphs: bool = False
    host_memory: bool = True  # tensors live in host memory: gloo moves them without staging (wire/staging.py)

    @abstractmethod
    def default_dtype(self) -> torch.dtype:
        """The dtype `--dtype auto` means on this device."""

    @abstractmethod
    def torch_device(self, local_rank: int = 0) -> torch.device:
        """The device a worker of this local rank computes on (no side effects)."""

    def set_device(self, local_rank: int = 0) -> torch.device:
        """Bind this process to its device (CUDA: the current device) and return it."""
        return self.torch_device(local_rank)

    @abstractmethod
    def configure_process(self, threads: int | None) -> None:
        """Once per process, before the first tensor of the model: intra-op threads (None: leave torch's
        setting) and the allocator's settings."""

    def configure_runner(self) -> None:
        """Once per process that holds a model (a ModelRunner), before its weights load."""

    @abstractmethod
    def kv_cache_bytes(self, requested: KvRequest, gpu_memory_utilization: float, weights_bytes: int) -> int:
        """Bytes for the KV cache. `requested`: --kv-cache-memory (bytes, a fraction, or None);
        `weights_bytes`: what the model's weights will take on the device (not loaded yet)."""

    def kv_zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed KV cache tensor (one per slice or pool: gigabytes, allocated once per runner)."""
        return torch.zeros(shape, dtype=dtype, device=device)

    def synchronize(self) -> None:
        """Wait for the device's queued work (timing); a no-op where work is synchronous."""

    def empty_cache(self) -> None:
        """Hand memory the framework or the allocator keeps cached back to the system (sleep, the CUDA memory
        probe); a no-op unless a platform keeps some (CPU: the heap, CUDA: torch's caching allocator)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


__all__ = ["KvRequest", "Platform"]
