"""Paged KV blocks (PagedAttention): one page table for the whole engine, whatever runs the layers.

Pure Python. Physical blocks carry reference counts so that later prefix sharing can map one block into
several block tables; a block returns to the free list only when its count reaches zero, and freeing a
block that is already free is an error rather than silent corruption.
"""
from __future__ import annotations

from collections import deque

from tdpipe.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    # -- capacity ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def usage(self) -> float:
        """Fraction of blocks in use (KV usage, TD-Pipe Fig. 12)."""
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence, num_tokens: int | None = None, reserve: int = 0) -> bool:
        """Whether `num_tokens` (default: all of seq's tokens) fit, keeping `reserve` blocks free."""
        n = seq.num_tokens if num_tokens is None else num_tokens
        need = self.blocks_needed(n) - len(seq.block_table)
        return need + reserve <= len(self.free_blocks)

    # -- allocation --------------------------------------------------------------------------------
    def _take(self) -> int:
        if not self.free_blocks:
            raise RuntimeError("out of KV blocks: the scheduler must check capacity before allocating")
        b = self.free_blocks.popleft()
        assert self.ref_counts[b] == 0, f"block {b} on the free list with ref count {self.ref_counts[b]}"
        self.ref_counts[b] = 1
        return b

    def allocate(self, seq: Sequence, num_tokens: int | None = None) -> list[int]:
        """Grow seq's block table to hold `num_tokens` (default: all its tokens); returns the new block ids."""
        n = seq.num_tokens if num_tokens is None else num_tokens
        need = self.blocks_needed(n) - len(seq.block_table)
        if need > len(self.free_blocks):
            raise RuntimeError(f"need {need} KV blocks for seq {seq.seq_id}, {len(self.free_blocks)} free")
        new = [self._take() for _ in range(max(0, need))]
        seq.block_table.extend(new)
        return new

    def can_append(self, seq: Sequence) -> bool:
        """Whether seq can get a slot for its next decode token (position num_tokens - 1)."""
        return self.blocks_needed(seq.num_tokens) <= len(seq.block_table) or bool(self.free_blocks)

    def append_slot(self, seq: Sequence) -> list[int]:
        return self.allocate(seq, seq.num_tokens)

    def fork(self, block_ids: list[int]) -> list[int]:
        """Share blocks with another table (copy-free): bump their reference counts."""
        for b in block_ids:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"cannot share free block {b}")
            self.ref_counts[b] += 1
        return list(block_ids)

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks (in reverse, so recently used blocks are reused last)."""
        for b in reversed(seq.block_table):
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"double free of KV block {b} (seq {seq.seq_id})")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_blocks.append(b)
        seq.block_table = []

    def reset(self) -> None:
        """Every block free again: only for an engine with no sequence left (recovery after an interrupt)."""
        self.ref_counts = [0] * self.num_blocks
        self.free_blocks = deque(range(self.num_blocks))

    def check_no_leaks(self) -> None:
        """Every block free with count 0; call when no sequence holds blocks."""
        leaked = [b for b, c in enumerate(self.ref_counts) if c != 0]
        if leaked or len(self.free_blocks) != self.num_blocks or len(set(self.free_blocks)) != self.num_blocks:
            raise AssertionError(f"KV block leak: {len(leaked)} blocks still referenced, "
                                 f"{len(self.free_blocks)}/{self.num_blocks} on the free list")
