"""The sliding-window layers' own KV block pool: per sequence, only the blocks its window can still see.

vLLM's hybrid KV cache idea: a local (sliding-window) layer's query at position p reads keys p-W+1 .. p only,
so a block that ends at or before p-W+1 is never read again by that sequence. Local layers therefore keep a
block table of their own, over a pool of their own, in step with the global table (same logical index, same
length), and after each step the blocks wholly out of the window of the sequence's next query are given back
to the pool; their entries become NULL_BLOCK. Between steps a sequence holds at most ceil(W / block_size) + 1
local blocks. While a step runs it holds what that step writes as well: a prefill chunk of C tokens starting
at position p needs the blocks of positions max(0, p-W+1) .. p+C-1, up to ceil((C + W - 1) / block_size) + 1
(a whole 4k-token prompt prefilled in one step holds all its blocks until the step returns; chunked prefill,
`--policy hybrid`, bounds it by the chunk).

Block 0 is the null block: never handed out and never written (its KV stays zeros), so a table entry that
points at it is a valid index the attention masks (the window excludes it). Blocks are reference counted for
fork (n > 1): a child shares its parent's live blocks, and a shared block about to be written is copied first
(copy-on-write), as in the global table (core/block_manager.py).

Prefix caching (vLLM's hybrid KV cache manager: one cache per KV-cache group, and a hit is the longest prefix
valid for every group): a full, computed local block is named by the same chained hash as the global block of
the same index (core/prefix_cache.py; the block manager names both). A named block that leaves the window, or
whose sequence ends, is not freed but kept *evictable* (LRU) in this pool's own cache, so a later request can
map it again. A prefix of k blocks is reusable for the local layers only if the blocks its next query (position
k * block_size) reads, first_needed(k * block_size) .. k - 1, are all still cached here; blocks before those
are never read and stay NULL_BLOCK (`longest_valid`).
"""
from __future__ import annotations

from collections import deque

from tdpipe.core.prefix_cache import BlockHash, PrefixCache
from tdpipe.sequence import Sequence

NULL_BLOCK = 0  # table entry of a block given back: a valid index, never written, masked by the window


class WindowBlockPool:
    """Blocks 1 .. num_blocks-1 of the local layers' cache (block 0 is the null block), per-sequence tables
    on `Sequence.local_block_table`."""

    def __init__(self, num_blocks: int, block_size: int, window: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a sliding-window pool needs >= 2 blocks (one is the null block), got {num_blocks}")
        if window < 1:
            raise ValueError(f"sliding window must be >= 1, got {window}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(1, num_blocks))
        self.cache = PrefixCache(num_blocks)  # named local blocks; block 0 is never named
        self._live_from: dict[int, int] = {}  # seq_id -> index of its first entry that is not NULL_BLOCK
        self.peak_used = 0  # most blocks in use at once (tests and stats)

    # -- capacity ---------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones plus evictable cached ones (evicted on demand)."""
        return len(self.free_blocks) + self.cache.num_evictable

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - 1 - self.num_free_blocks

    def max_blocks_per_seq(self) -> int:
        """Live local blocks of one sequence between steps: ceil(W / block_size) + 1."""
        return -(-self.window // self.block_size) + 1

    def first_needed(self, pos: int) -> int:
        """Index of the first block a query at position `pos` still reads: blocks before it end at or before
        pos - W + 1."""
        return max(0, pos - self.window + 1) // self.block_size

    def blocks_to_add(self, seq: Sequence, num_tokens: int) -> int:
        """Fresh blocks `allocate(seq, num_tokens)` takes: the table grows to hold num_tokens positions, from
        the first block its next query (position seq.num_computed_tokens) reads."""
        n_blocks = -(-num_tokens // self.block_size)
        start = max(len(seq.local_block_table), self.first_needed(seq.num_computed_tokens))
        return max(0, n_blocks - start)

    def live_blocks(self, seq: Sequence) -> int:
        return sum(1 for b in seq.local_block_table if b != NULL_BLOCK)

    # -- allocation -------------------------------------------------------------------------------------
    def _take(self) -> int:
        """A fresh block with count 1: from the free list, else the least recently released cached block."""
        if self.free_blocks:
            b = self.free_blocks.popleft()
        elif self.cache.num_evictable:
            b = self.cache.evict_lru()
        else:
            raise RuntimeError("out of sliding-window KV blocks: the scheduler must check capacity first")
        self.ref_counts[b] = 1
        return b

    def _release(self, b: int) -> None:
        self.ref_counts[b] -= 1
        if self.ref_counts[b] == 0:
            if self.cache.hash_of(b) is not None:
                self.cache.add_evictable(b)
            else:
                self.free_blocks.append(b)
        elif self.ref_counts[b] < 0:
            raise RuntimeError(f"double free of sliding-window KV block {b}")

    # -- prefix caching ---------------------------------------------------------------------------------
    def register(self, seq: Sequence, index: int, h: BlockHash) -> None:
        """Name seq's local block `index` (full and computed) by `h`, the hash of the global block of the
        same index; a NULL_BLOCK entry (already out of the window) has nothing to name."""
        table = seq.local_block_table
        if index < len(table) and table[index] != NULL_BLOCK:
            self.cache.register(table[index], h)

    def longest_valid(self, hashes: list[BlockHash]) -> int:
        """Largest k <= len(hashes) such that the local blocks a query at position k * block_size reads,
        first_needed(k * block_size) .. k - 1, are all cached here (k = 0 always is). The whole hit is
        checked first (a window's lookups), so the usual case, nothing evicted, costs no scan."""
        k = len(hashes)
        if k and all(self.cache.lookup(h) is not None for h in hashes[self.first_needed(k * self.block_size):]):
            return k
        run = 0  # cached blocks in a row ending at the current index
        best = 0
        for i, h in enumerate(hashes):
            run = run + 1 if self.cache.lookup(h) is not None else 0
            k = i + 1
            if run >= k - self.first_needed(k * self.block_size):
                best = k
        return best

    def hit_blocks(self, hashes: list[BlockHash]) -> list[int]:
        """The cached local blocks a prefix of len(hashes) blocks maps in (valid per `longest_valid`)."""
        k = len(hashes)
        return [self.cache.lookup(h) for h in hashes[self.first_needed(k * self.block_size):k]]

    def revived(self, hashes: list[BlockHash]) -> int:
        """Of `hit_blocks(hashes)`, how many are evictable (mapping them takes them from the free count)."""
        return sum(1 for b in self.hit_blocks(hashes) if self.ref_counts[b] == 0)

    def allocate_with_hits(self, seq: Sequence, hashes: list[BlockHash], num_tokens: int) -> None:
        """Map the cached local blocks of a prefix of len(hashes) blocks into seq's empty table (entries before
        the window NULL_BLOCK), then grow it to `num_tokens` positions. Capacity checked by the caller."""
        if seq.local_block_table:
            raise ValueError(f"seq {seq.seq_id} already holds sliding-window blocks")
        k = len(hashes)
        first = self.first_needed(k * self.block_size)
        hits = self.hit_blocks(hashes)
        if any(b is None for b in hits):
            raise RuntimeError(f"seq {seq.seq_id}: a sliding-window block of its cached prefix is gone")
        for b in hits:  # revive before taking fresh blocks, so the fresh ones cannot evict a hit
            if self.ref_counts[b] == 0:
                self.cache.revive(b)
            self.ref_counts[b] += 1
        seq.local_block_table = [NULL_BLOCK] * first + hits
        self._live_from[seq.seq_id] = first
        n_blocks = -(-num_tokens // self.block_size)
        seq.local_block_table.extend(self._take() for _ in range(max(0, n_blocks - k)))
        self.peak_used = max(self.peak_used, self.num_used_blocks)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Trim seq's table to its window, then grow it to hold `num_tokens` positions. Blocks wholly before
        the next query's window are never allocated (entries NULL_BLOCK)."""
        self.trim(seq)
        table = seq.local_block_table
        n_blocks = -(-num_tokens // self.block_size)
        if n_blocks <= len(table):
            return
        skip = max(0, self.first_needed(seq.num_computed_tokens) - len(table))
        if n_blocks - len(table) - skip > self.num_free_blocks:
            raise RuntimeError(f"need {n_blocks - len(table) - skip} sliding-window KV blocks for seq "
                               f"{seq.seq_id}, {self.num_free_blocks} free")
        old = len(table)
        table.extend([NULL_BLOCK] * skip)
        table.extend(self._take() for _ in range(n_blocks - len(table)))
        self._live_from.setdefault(seq.seq_id, old + skip if old == 0 else 0)
        self.peak_used = max(self.peak_used, self.num_used_blocks)

    def trim(self, seq: Sequence) -> int:
        """Give back seq's blocks that its next query (position seq.num_computed_tokens) can no longer see;
        returns how many entries became NULL_BLOCK. Call after each step the sequence took part in."""
        table = seq.local_block_table
        end = min(self.first_needed(seq.num_computed_tokens), len(table))
        i = self._live_from.get(seq.seq_id, 0)
        if i >= end:
            return 0
        for j in range(i, end):
            b = table[j]
            if b != NULL_BLOCK:
                self._release(b)
                table[j] = NULL_BLOCK
        self._live_from[seq.seq_id] = end
        return end - i

    def free(self, seq: Sequence) -> None:
        """Release every live block of seq (finish, abort, preemption)."""
        for b in reversed(seq.local_block_table):
            if b != NULL_BLOCK:
                self._release(b)
        seq.local_block_table = []
        self._live_from.pop(seq.seq_id, None)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares the parent's live blocks (reference counts)."""
        for b in parent.local_block_table:
            if b != NULL_BLOCK:
                if self.ref_counts[b] <= 0:
                    raise RuntimeError(f"cannot share free sliding-window block {b}")
                self.ref_counts[b] += 1
        child.local_block_table = list(parent.local_block_table)
        if parent.seq_id in self._live_from:
            self._live_from[child.seq_id] = self._live_from[parent.seq_id]

    def cow_needed(self, seq: Sequence) -> bool:
        """Whether the block the next decode writes (position num_tokens - 1) exists and is shared."""
        i = (seq.num_tokens - 1) // self.block_size
        table = seq.local_block_table
        return seq.num_tokens > 0 and i < len(table) and self.ref_counts[table[i]] > 1

    def prepare_append(self, seq: Sequence) -> tuple[int, int] | None:
        """Copy-on-write of the block seq writes next, when shared: (src, dst) for the executor to copy."""
        if not self.cow_needed(seq):
            return None
        i = (seq.num_tokens - 1) // self.block_size
        src = seq.local_block_table[i]
        dst = self._take()
        seq.local_block_table[i] = dst
        self.ref_counts[src] -= 1  # stays >= 1: another sequence holds it
        self.peak_used = max(self.peak_used, self.num_used_blocks)
        return src, dst

    # -- reset and checks ---------------------------------------------------------------------------------
    def reset(self) -> None:
        self.ref_counts = [0] * self.num_blocks
        self.free_blocks = deque(range(1, self.num_blocks))
        self.cache.clear()
        self._live_from.clear()

    def check_no_leaks(self) -> None:
        leaked = [b for b, c in enumerate(self.ref_counts) if c != 0]
        avail = set(self.free_blocks) | set(self.cache.evictable)
        if leaked or len(avail) != self.num_blocks - 1 or NULL_BLOCK in avail or self._live_from:
            raise AssertionError(f"sliding-window KV block leak: {len(leaked)} blocks still referenced, "
                                 f"{len(self.free_blocks)} free + {self.cache.num_evictable} evictable of "
                                 f"{self.num_blocks - 1}")
        self.cache.check(self.ref_counts)


__all__ = ["NULL_BLOCK", "WindowBlockPool"]
