"""Seeded randomness by position: every draw of a seeded request is a pure function of (seed, index).

A request recomputed after preemption samples position i with the same draw as without preemption, whatever
was sampled or dropped meanwhile, and sample i of a request is the same whatever shares its batch.
"""
from __future__ import annotations

import numpy as np

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """A 64-bit avalanche (splitmix64's finaliser): nearby inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_key(seed: int, index: int) -> int:
    """The random stream of output token `index` of a request seeded with `seed`, as a generator seed.

    Every token's draw is a pure function of (seed, index), so nothing is lost when a request is preempted
    and recomputed, whatever was sampled (or sampled and thrown away) meanwhile, and nothing depends on
    what else shares the batch. Negative seeds are taken modulo 2**64, as torch.manual_seed takes them."""
    return _mix64(_mix64(seed & _MASK64) ^ (index & _MASK64))


def sample_seed(seed: int, sample_index: int) -> int:
    """The seed of sample `sample_index` of an n > 1 request: sample 0 keeps the request's seed (so n=1
    draws as before), the others get unrelated streams. A sample's tokens depend on nothing else."""
    return seed if sample_index == 0 else _mix64((seed & _MASK64) ^ _mix64(sample_index))


def draw_keys(seeds: list[int], indices: list[int]) -> list[int]:
    """`draw_key` for many rows at once (numpy uint64 arithmetic wraps like the & _MASK64 above): a decode
    step of 256 seeded rows pays ~0.08 ms here instead of ~0.18 ms of Python integer arithmetic."""
    if len(seeds) < 8:
        return [draw_key(s, i) for s, i in zip(seeds, indices)]
    x = np.array([s & _MASK64 for s in seeds], dtype=np.uint64)
    return _mix64_np(_mix64_np(x) ^ np.array(indices, dtype=np.uint64)).tolist()


def _mix64_np(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


__all__ = ["draw_key", "draw_keys", "sample_seed"]
