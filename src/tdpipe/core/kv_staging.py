"""The control plane's half of prefill/decode disaggregation's KV transfer: which staging slots of the shared
area (worker/kv_transfer.py) each request holds. A prompt takes one slot per KV block when it is admitted on a
prefill instance (so its prefill step can export at once) and gives them back when the decode step that
imported them returned, or when it finishes or is aborted before that."""
from __future__ import annotations

from collections import deque


class StagingSlots:
    """A free list of staging slots and the slots each sequence holds."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"kv_transfer_blocks must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.free: deque[int] = deque(range(num_slots))
        self.held: dict[int, list[int]] = {}  # seq_id -> its slots, one per KV block, in table order

    @property
    def num_free(self) -> int:
        return len(self.free)

    def take(self, seq_id: int, n: int) -> list[int]:
        if seq_id in self.held:
            raise RuntimeError(f"seq {seq_id} already holds staging slots")
        if n > len(self.free):
            raise RuntimeError(f"need {n} staging slots for seq {seq_id}, {len(self.free)} free")
        slots = [self.free.popleft() for _ in range(n)]
        self.held[seq_id] = slots
        return slots

    def release(self, seq_id: int) -> None:
        """Give back seq's slots; nothing if it holds none (idempotent)."""
        self.free.extend(self.held.pop(seq_id, ()))

    def check_no_leaks(self) -> None:
        if self.held or len(set(self.free)) != self.num_slots:
            raise AssertionError(f"staging slot leak: {len(self.held)} sequences hold slots, "
                                 f"{len(self.free)} of {self.num_slots} free")


__all__ = ["StagingSlots"]
