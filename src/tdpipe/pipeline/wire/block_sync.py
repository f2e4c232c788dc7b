"""Block-table deltas between the engine's page table and the stages' copies (gLLM §3.3 preemptive metadata).

Every stage needs each sequence's block table to find its KV, but the tables only grow by a block every
16 tokens, so the engine sends what is new since the last message: per sequence (epoch, start, new blocks).
A sequence's epoch is its preemption count: after a recompute preemption its table is rebuilt from scratch
and the stage replaces its copy. Finished sequences are listed in `freed` so the copies do not pile up.
Sliding-window layers' tables (core/window_blocks.py) travel the same way through a second sender / mirror:
they grow in step with the global ones; entries that leave the window turn into the null block on the
engine's side only, and the stages keep the old ids there, which the window never reads.
Pure Python: the same two classes run in the engine and in every stage process.
"""
from __future__ import annotations

Delta = tuple[int, int, list[int]]  # (epoch, start index, blocks from start on)


class BlockTableSender:
    """Engine side: remembers, per sequence, how much of its table the stages already hold."""

    def __init__(self) -> None:
        self._sent: dict[int, tuple[int, int]] = {}  # seq_id -> (epoch, number of blocks sent)
        self._freed: list[int] = []

    def deltas(self, seq_ids: list[int], epochs: list[int], tables: list[list[int]]) -> list[Delta]:
        out: list[Delta] = []
        for sid, ep, table in zip(seq_ids, epochs, tables):
            known = self._sent.get(sid)
            start = known[1] if known is not None and known[0] == ep and known[1] <= len(table) else 0
            out.append((ep, start, table[start:]))
            self._sent[sid] = (ep, len(table))
        return out

    def release(self, seq_ids: list[int]) -> None:
        """These sequences finished: tell the stages with the next message."""
        for sid in seq_ids:
            if self._sent.pop(sid, None) is not None:
                self._freed.append(sid)

    def forget(self, seq_ids: list[int]) -> None:
        """These sequences finished, and another sender's `freed` list tells the stages (a second table)."""
        for sid in seq_ids:
            self._sent.pop(sid, None)

    def take_freed(self) -> list[int]:
        freed, self._freed = self._freed, []
        return freed

    def __len__(self) -> int:
        return len(self._sent)


class BlockTableMirror:
    """Stage side: rebuilds whole tables from the deltas, in message order."""

    def __init__(self) -> None:
        self.tables: dict[int, tuple[int, list[int]]] = {}  # seq_id -> (epoch, table)

    def apply(self, seq_ids: list[int], deltas: list[Delta], freed: list[int]) -> list[list[int]]:
        for sid in freed:
            self.tables.pop(sid, None)
        out: list[list[int]] = []
        for sid, (ep, start, blocks) in zip(seq_ids, deltas):
            known = self.tables.get(sid)
            if start == 0 or known is None or known[0] != ep:
                if start != 0:
                    raise RuntimeError(f"block-table delta for seq {sid} starts at {start} but the stage "
                                       "holds no table for it (messages lost or out of order)")
                table = list(blocks)
            else:
                table = known[1]
                if len(table) != start:
                    raise RuntimeError(f"block-table delta for seq {sid} starts at {start}; the stage holds "
                                       f"{len(table)} blocks")
                table.extend(blocks)
            self.tables[sid] = (ep, table)
            out.append(table)
        return out

    def __len__(self) -> int:
        return len(self.tables)
