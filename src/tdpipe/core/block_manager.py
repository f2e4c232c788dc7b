"""Paged KV blocks (PagedAttention): one page table for the whole engine, whatever runs the layers.

Pure Python. The lecture (001 §3.3-3.4) treats the KV cache as paged memory: each sequence's block table maps
its logical blocks to physical ones, and a physical block can appear in several tables so that requests share
cached tokens instead of storing them twice. Hence reference counts: a block is released only when its count
reaches zero, and freeing a block that is already free is an error rather than silent corruption. Three kinds
of sharing build on them:

- fork (parallel sampling, n > 1): a child sequence gets its parent's table, every count +1;
- copy-on-write: a sequence about to write into a block it shares gets a private copy first
  (`prepare_append`); only a partial last block is ever written, so only it is ever copied;
- prefix caching (`enable_prefix_caching`, see `prefix_cache.py`): full blocks are named by a hash of their
  prefix, a new request maps the longest named prefix into its table, and a named block whose count reaches
  zero stays *evictable* (LRU) instead of free, so a later request can still hit it. Evictable blocks count as
  free capacity: a fresh allocation takes the free list first, then evicts the oldest.

Every block is in exactly one of: the free list, the evictable LRU, or referenced (count > 0).

With sliding-window (local) layers (`window`), those layers' KV lives in a second, smaller pool
(core/window_blocks.py): every allocation, fork, copy-on-write and free here does the same on the sequence's
local table, and capacity checks ask both pools. Prefix caching then keeps a cache per pool, as vLLM's hybrid
KV cache manager does per KV-cache group: committing a full block names the local block of the same index too,
and a prefix hit is the longest one valid for both, i.e. whose next query still finds its last W tokens' local
KV cached (`WindowBlockPool.longest_valid`); the local blocks before that window are not needed.
"""
from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from tdpipe.core.prefix_cache import (ROOT_HASH, BlockHash, ExtraKey, PrefixCache, encode_extra_key, hash_block,
                                      iter_block_hashes)
from tdpipe.core.window_blocks import WindowBlockPool
from tdpipe.sequence import Sequence

log = logging.getLogger("tdpipe")


@dataclass
class _SeqHashes:
    """Per sequence: the extra key and the chained hashes of its full blocks committed so far (logical order),
    so committing a new block hashes 16 tokens rather than the whole sequence again."""

    extra: bytes
    hashes: list[BlockHash] = field(default_factory=list)


class PrefixPlan(NamedTuple):
    """What `allocate_with_prefix` would do now: tokens already cached, and how many blocks it would take
    from `num_free_blocks` (fresh blocks plus cached blocks revived from the evictable LRU)."""

    num_cached_tokens: int
    num_new_blocks: int


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = False,
                 window: int | None = None, num_window_blocks: int = 0) -> None:
        """`window` W and `num_window_blocks`: the sliding-window layers' own pool (None: no local layers, or
        they keep all their blocks in this table, as at pp > 1)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window_pool = WindowBlockPool(num_window_blocks, block_size, window) if window else None
        if self.window_pool is not None:
            log.info("sliding-window layers (window %d) keep their KV in a pool of their own: %d blocks of %d "
                     "tokens, beside %d blocks for the global layers", window, num_window_blocks - 1, block_size,
                     num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.cache = PrefixCache(num_blocks)
        self._seq_hashes: dict[int, _SeqHashes] = {}  # seq_id -> committed hash chain (caching on only)
        # Counters (monotonic, like Prometheus counters; reset() keeps them): tokens looked up / found cached
        # by allocate_with_prefix.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- capacity ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones plus evictable cached ones (evicted on demand)."""
        return len(self.free_blocks) + self.cache.num_evictable

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_evictable_blocks(self) -> int:
        return self.cache.num_evictable

    def usage(self) -> float:
        """Fraction of blocks in use (KV usage, TD-Pipe Fig. 12); with a sliding-window pool, the fuller one."""
        if self.window_pool is not None:
            wp = self.window_pool
            return max(self.num_used_blocks / self.num_blocks, wp.num_used_blocks / (wp.num_blocks - 1))
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence, num_tokens: int | None = None, reserve: int = 0) -> bool:
        """Whether `num_tokens` (default: all of seq's tokens) fit, keeping `reserve` blocks free."""
        n = seq.num_tokens if num_tokens is None else num_tokens
        need = self.blocks_needed(n) - len(seq.block_table)
        return need + reserve <= self.num_free_blocks and self.window_fits(seq, n)

    def window_fits(self, seq: Sequence, num_tokens: int, reserve: int = 0, prefix: bool = False) -> bool:
        """Whether the sliding-window pool has the blocks to grow seq to `num_tokens` positions (keeping
        `reserve` free); True without one. `prefix`: seq (holding no blocks) is to be allocated by
        `allocate_with_prefix`, so its cached prefix's local blocks are mapped, not taken fresh."""
        wp = self.window_pool
        if wp is None:
            return True
        if prefix and self.enable_prefix_caching and not seq.block_table and not seq.local_block_table:
            hits, hashes = self._match_seq(seq)
            need = max(0, self.blocks_needed(num_tokens) - len(hits)) + wp.revived(hashes)
        else:
            need = wp.blocks_to_add(seq, num_tokens)
        return need + reserve <= wp.num_free_blocks

    def chunk_room(self, seq: Sequence) -> int:
        """Tokens seq can add now (chunked prefill): what its last block and the free blocks hold, in both
        pools."""
        bs = self.block_size
        room = (len(seq.block_table) + self.num_free_blocks) * bs - seq.num_computed_tokens
        wp = self.window_pool
        if wp is not None:
            start = max(len(seq.local_block_table), wp.first_needed(seq.num_computed_tokens))
            room = min(room, (start + wp.num_free_blocks) * bs - seq.num_computed_tokens)
        return room

    # -- allocation --------------------------------------------------------------------------------
    def _take(self) -> int:
        """A fresh block with count 1: from the free list, else the least recently freed cached block."""
        if self.free_blocks:
            b = self.free_blocks.popleft()
        elif self.cache.num_evictable:
            b = self.cache.evict_lru()
        else:
            raise RuntimeError("out of KV blocks: the scheduler must check capacity before allocating")
        assert self.ref_counts[b] == 0, f"block {b} free or evictable with ref count {self.ref_counts[b]}"
        self.ref_counts[b] = 1
        return b

    def allocate(self, seq: Sequence, num_tokens: int | None = None) -> list[int]:
        """Grow seq's block table to hold `num_tokens` (default: all its tokens); returns the new block ids."""
        n = seq.num_tokens if num_tokens is None else num_tokens
        need = self.blocks_needed(n) - len(seq.block_table)
        if need > self.num_free_blocks:
            raise RuntimeError(f"need {need} KV blocks for seq {seq.seq_id}, {self.num_free_blocks} free")
        if self.window_pool is not None:  # raises, changing nothing, when the local pool is short
            self.window_pool.allocate(seq, n)
        new = [self._take() for _ in range(max(0, need))]
        seq.block_table.extend(new)
        return new

    def _cow_needed(self, seq: Sequence) -> bool:
        """Whether the block that the next decode writes (position num_tokens - 1) exists and is shared."""
        if seq.num_tokens == 0:
            return False
        i = (seq.num_tokens - 1) // self.block_size
        return i < len(seq.block_table) and self.ref_counts[seq.block_table[i]] > 1

    def can_append(self, seq: Sequence) -> bool:
        """Whether seq can get a slot for its next decode token (position num_tokens - 1): a new block when
        the last one is full, or a private copy when the last one is shared (copy-on-write)."""
        wp = self.window_pool
        if wp is not None:
            local = wp.blocks_to_add(seq, seq.num_tokens) + (1 if wp.cow_needed(seq) else 0)
            if local > wp.num_free_blocks:
                return False
        if self.blocks_needed(seq.num_tokens) <= len(seq.block_table) and not self._cow_needed(seq):
            return True
        return self.num_free_blocks > 0

    def append_slot(self, seq: Sequence) -> list[int]:
        return self.allocate(seq, seq.num_tokens)

    def writes_in_place(self, seq: Sequence) -> bool:
        """Whether seq's next decode token (position num_tokens - 1) lands in a block it already holds alone
        and uncached, with no sliding-window pool: then `append_slot` and `prepare_append` would change
        nothing, and the scheduler skips them (15 of 16 decode steps with 16-token blocks)."""
        n = seq.num_tokens
        if n == 0 or self.window_pool is not None:
            return False
        i = (n - 1) // self.block_size
        table = seq.block_table
        return i < len(table) and self.ref_counts[table[i]] == 1 and self.cache.hash_of(table[i]) is None

    def fork(self, block_ids: list[int]) -> list[int]:
        """Share blocks with another table (copy-free): bump their reference counts."""
        for b in block_ids:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"cannot share free block {b}")
            self.ref_counts[b] += 1
        return list(block_ids)

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks. In reverse, so a sequence's tail blocks, the least likely to be shared, are
        reused (or evicted) before its head. A block reaching count 0 goes to the evictable LRU if it is
        cached, to the free list otherwise. Validated first: a double free raises and changes nothing."""
        for b, n in Counter(seq.block_table).items():
            if self.ref_counts[b] < n:
                raise RuntimeError(f"double free of KV block {b} (seq {seq.seq_id})")
        for b in reversed(seq.block_table):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if self.cache.hash_of(b) is not None:
                    self.cache.add_evictable(b)
                else:
                    self.free_blocks.append(b)
        seq.block_table = []
        self._seq_hashes.pop(seq.seq_id, None)
        if self.window_pool is not None:
            self.window_pool.free(seq)

    def trim_window(self, seq: Sequence) -> None:
        """After a step: give back seq's local blocks that its next query can no longer see."""
        if self.window_pool is not None and seq.local_block_table:
            self.window_pool.trim(seq)

    # -- fork and copy-on-write (parallel sampling) ---------------------------------------------------
    def fork_seq(self, parent: Sequence, child: Sequence) -> None:
        """Give `child` (empty table) `parent`'s blocks, shared by reference count: the prompt is prefilled
        once for n samples. The caller copies num_computed_tokens and the tokens themselves."""
        if child.seq_id == parent.seq_id:
            raise ValueError(f"fork_seq: child and parent have the same seq_id {parent.seq_id}")
        if child.block_table:
            raise ValueError(f"fork_seq: child seq {child.seq_id} already holds "
                             f"{len(child.block_table)} blocks")
        child.block_table = self.fork(parent.block_table)
        if self.window_pool is not None:
            self.window_pool.fork(parent, child)
        st = self._seq_hashes.get(parent.seq_id)
        if st is not None:
            self._seq_hashes[child.seq_id] = _SeqHashes(st.extra, list(st.hashes))

    def prepare_append(self, seq: Sequence) -> tuple[int, int] | None:
        """Copy-on-write before seq writes its next token's KV (position num_tokens - 1; call after
        `append_slot`). If that block is shared, seq's entry moves to a fresh block and the old one loses a
        reference; returns (src, dst) so the executor copies the KV of src into dst before the step runs
        (on every pipeline stage). None when the block is seq's alone."""
        if seq.num_tokens == 0:
            return None
        i = (seq.num_tokens - 1) // self.block_size
        if i >= len(seq.block_table):
            raise RuntimeError(f"seq {seq.seq_id} has no block for position {seq.num_tokens - 1}: "
                               "call append_slot before prepare_append")
        src = seq.block_table[i]
        if self.ref_counts[src] <= 0:
            raise RuntimeError(f"seq {seq.seq_id} holds free KV block {src}")
        if self.cache.hash_of(src) is not None:
            raise RuntimeError(f"seq {seq.seq_id} would write into cached (full) KV block {src}: "
                               "committed more tokens than were computed?")
        if self.ref_counts[src] == 1:
            return None
        dst = self._take()
        seq.block_table[i] = dst
        self.ref_counts[src] -= 1  # stays >= 1: another sequence still holds src
        return src, dst

    def prepare_append_window(self, seq: Sequence) -> tuple[int, int] | None:
        """`prepare_append` for seq's local table (the block it writes is shared after a fork). The pair is
        given in the executor's joint numbering: local block b is `num_blocks + b` (worker/model_runner.py
        copies it in the local layers' cache). None without a window pool or when nothing is shared."""
        if self.window_pool is None:
            return None
        cow = self.window_pool.prepare_append(seq)
        return None if cow is None else (self.num_blocks + cow[0], self.num_blocks + cow[1])

    # -- prefix caching --------------------------------------------------------------------------------
    def _match(self, token_ids: list[int], extra: bytes) -> tuple[list[int], list[BlockHash]]:
        """Cached blocks (and their hashes) of the longest full-block prefix, leaving >= 1 token to compute:
        the model must run on at least the last token to give logits for the next one."""
        if not self.enable_prefix_caching or not token_ids:
            return [], []
        blocks: list[int] = []
        hashes: list[BlockHash] = []
        max_blocks = (len(token_ids) - 1) // self.block_size
        for h in iter_block_hashes(token_ids, self.block_size, extra, max_blocks=max_blocks):
            b = self.cache.lookup(h)
            if b is None:
                break
            blocks.append(b)
            hashes.append(h)
        return self._cut_to_window(blocks, hashes)

    def _cut_to_window(self, blocks: list[int], hashes: list[BlockHash]) -> tuple[list[int], list[BlockHash]]:
        """The longest prefix of a global hit that the sliding-window layers can reuse too (their last W
        tokens' KV still cached in their pool); the whole hit without such layers."""
        if self.window_pool is None:
            return blocks, hashes
        k = self.window_pool.longest_valid(hashes)
        return blocks[:k], hashes[:k]

    def _match_seq(self, seq: Sequence, extra: bytes = b"") -> tuple[list[int], list[BlockHash]]:
        """`_match` over seq's tokens, with its block hashes memoised on the sequence (tokens only ever grow,
        so a waiting request that admission checks many times is hashed once; later checks are lookups)."""
        if extra or not self.enable_prefix_caching:
            return self._match(seq.all_token_ids, extra)
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        memo = seq.block_hashes
        blocks: list[int] = []
        hashes: list[BlockHash] = []
        toks: list[int] | None = None
        parent = ROOT_HASH
        for i in range(max_blocks):
            if i < len(memo):
                h = memo[i]
            else:
                if toks is None:
                    toks = seq.all_token_ids
                h = hash_block(parent, toks[i * bs:(i + 1) * bs])
                memo.append(h)
            b = self.cache.lookup(h)
            if b is None:
                break
            blocks.append(b)
            hashes.append(h)
            parent = h
        return self._cut_to_window(blocks, hashes)

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens of seq (not holding blocks) that `allocate_with_prefix` would find cached now; read-only."""
        return len(self._match_seq(seq)[0]) * self.block_size

    def probe_cached_tokens(self, seq: Sequence) -> int:
        """A cheap running estimate of `cached_prefix_tokens` for a request that waits (gLLM's #WP counts only
        what a request will really prefill): it resumes from the blocks that matched last time, checking the
        last of them is still cached, so a queue of a thousand requests sharing a long prefix costs a few
        lookups each per call instead of one per block. Stale only if a middle block was evicted since."""
        if not self.enable_prefix_caching or seq.num_tokens == 0:
            return 0
        k = seq.probed_blocks
        memo = seq.block_hashes
        if k and (k > len(memo) or self.cache.lookup(memo[k - 1]) is None):
            k = 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        bs = self.block_size
        toks: list[int] | None = None
        while k < max_blocks:
            if k < len(memo):
                h = memo[k]
            else:
                if toks is None:
                    toks = seq.all_token_ids
                h = hash_block(memo[k - 1] if k else ROOT_HASH, toks[k * bs:(k + 1) * bs])
                memo.append(h)
            if self.cache.lookup(h) is None:
                break
            k += 1
        seq.probed_blocks = k
        if self.window_pool is not None:
            k = self.window_pool.longest_valid(memo[:k])
        return k * bs

    def find_cached_prefix(self, token_ids: list[int], extra_key: ExtraKey = None) -> list[int]:
        """Block ids of the longest cached full-block prefix of `token_ids`, at most (len-1)//block_size
        blocks. Read-only: takes no reference and counts no statistics. [] when caching is off."""
        return self._match(token_ids, encode_extra_key(extra_key))[0]

    def prefix_plan(self, seq: Sequence, num_tokens: int | None = None,
                    extra_key: ExtraKey = None) -> PrefixPlan:
        """What `allocate_with_prefix(seq, num_tokens)` would do now, for capacity checks (TD-Pipe
        Algorithm 1, gLLM Eq. 3 count only what a request really prefills and allocates)."""
        if seq.block_table:
            raise ValueError(f"prefix_plan: seq {seq.seq_id} already holds blocks")
        hits, _ = self._match_seq(seq, encode_extra_key(extra_key))
        n = seq.num_tokens if num_tokens is None else num_tokens
        fresh = max(0, self.blocks_needed(n) - len(hits))
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)
        return PrefixPlan(len(hits) * self.block_size, fresh + revived)

    def can_allocate_with_prefix(self, seq: Sequence, num_tokens: int | None = None, reserve: int = 0,
                                 extra_key: ExtraKey = None) -> bool:
        """`can_allocate` for `allocate_with_prefix`: cached blocks in use cost nothing, evictable ones do."""
        return self.prefix_plan(seq, num_tokens, extra_key).num_new_blocks + reserve <= self.num_free_blocks

    def allocate_with_prefix(self, seq: Sequence, num_tokens: int | None = None,
                             extra_key: ExtraKey = None) -> int:
        """Map the longest cached prefix of seq's tokens (prompt and outputs: a preempted sequence hits too)
        into its empty block table, then allocate fresh blocks up to `num_tokens` (default: all tokens).

        Cached blocks get a reference each (revived from the LRU if they had none). Returns the number of
        tokens already computed, a multiple of block_size and < seq.num_tokens; the engine sets
        num_computed_tokens to it and prefills the rest. With caching off: `allocate`, and returns 0."""
        if not self.enable_prefix_caching:
            self.allocate(seq, num_tokens)
            return 0
        if seq.block_table:
            raise ValueError(f"allocate_with_prefix: seq {seq.seq_id} already holds "
                             f"{len(seq.block_table)} blocks (free it first)")
        extra = encode_extra_key(extra_key)
        hits, hashes = self._match_seq(seq, extra)
        n = seq.num_tokens if num_tokens is None else num_tokens
        fresh = max(0, self.blocks_needed(n) - len(hits))
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)
        if fresh + revived > self.num_free_blocks:
            raise RuntimeError(f"need {fresh + revived} KV blocks for seq {seq.seq_id} "
                               f"({len(hits)} cached), {self.num_free_blocks} free")
        wp = self.window_pool
        if wp is not None:  # checked before anything changes
            local = fresh + wp.revived(hashes)
            if local > wp.num_free_blocks:
                raise RuntimeError(f"need {local} sliding-window KV blocks for seq {seq.seq_id} "
                                   f"({len(hits)} cached), {wp.num_free_blocks} free")
            wp.allocate_with_hits(seq, hashes, n)
        for b in hits:  # revive before taking fresh blocks, so the fresh ones cannot evict a hit
            if self.ref_counts[b] == 0:
                self.cache.revive(b)
            self.ref_counts[b] += 1
        seq.block_table = list(hits)
        seq.block_table.extend(self._take() for _ in range(fresh))
        self._seq_hashes[seq.seq_id] = _SeqHashes(extra, hashes)
        cached = len(hits) * self.block_size
        self.prefix_cache_queries += seq.num_tokens
        self.prefix_cache_hits += cached
        return cached

    def commit_full_blocks(self, seq: Sequence, num_computed_tokens: int | None = None) -> int:
        """Name seq's blocks that are full and computed (the first `num_computed_tokens`, default
        seq.num_computed_tokens; prompt and output tokens alike) so later requests hit them. Call after the
        step that computed them returned. A block whose content another block already holds stays unnamed
        (one block per prefix). Returns the number of blocks newly cached; 0 with caching off.

        A sequence allocated with plain `allocate` is committed with extra_key None."""
        if not self.enable_prefix_caching:
            return 0
        n = seq.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        st = self._seq_hashes.get(seq.seq_id)
        if (st is not None and n // self.block_size <= len(st.hashes)
                and 0 <= n <= len(seq.prompt_token_ids) + len(seq.output_token_ids)):
            return 0  # no block filled since the last call: most decode steps (the hot path)
        if not 0 <= n <= seq.num_tokens:
            raise ValueError(f"seq {seq.seq_id}: {n} computed tokens out of {seq.num_tokens}")
        full = n // self.block_size
        if full > len(seq.block_table):
            raise RuntimeError(f"seq {seq.seq_id}: {full} full blocks computed but only "
                               f"{len(seq.block_table)} in its block table")
        if st is None:
            st = self._seq_hashes[seq.seq_id] = _SeqHashes(b"")
        k = len(st.hashes)
        if k > len(seq.block_table):
            raise RuntimeError(f"seq {seq.seq_id}: stale prefix state ({k} hashed blocks, table of "
                               f"{len(seq.block_table)}); was its table replaced without free()?")
        if full <= k:
            return 0
        parent = st.hashes[-1] if k else ROOT_HASH
        new = 0
        hashes = iter_block_hashes(seq.all_token_ids, self.block_size, st.extra, start=k, parent=parent,
                                   max_blocks=full)
        for i, h in enumerate(hashes, start=k):
            st.hashes.append(h)
            b = seq.block_table[i]
            was_named = self.cache.hash_of(b) is not None
            if self.cache.register(b, h) and not was_named:
                new += 1
            if self.window_pool is not None:
                self.window_pool.register(seq, i, h)
        return new

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by prefix lookup (referenced or evictable)."""
        return len(self.cache)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Cached tokens / tokens looked up by allocate_with_prefix (0.0 before any lookup)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def prefix_cache_stats(self) -> dict[str, float | int]:
        return {"queries": self.prefix_cache_queries, "hits": self.prefix_cache_hits,
                "hit_rate": self.prefix_cache_hit_rate, "cached_blocks": self.num_cached_blocks,
                "evictable_blocks": self.num_evictable_blocks}

    # -- reset and checks ------------------------------------------------------------------------------
    def reset(self) -> None:
        """Every block free again and the prefix cache empty: only for an engine with no sequence left
        (recovery after an interrupt). The hit/query counters are kept."""
        self.ref_counts = [0] * self.num_blocks
        self.free_blocks = deque(range(self.num_blocks))
        self.cache.clear()
        self._seq_hashes.clear()
        if self.window_pool is not None:
            self.window_pool.reset()

    def check_no_leaks(self) -> None:
        """Every block free or evictable with count 0; call when no sequence holds blocks."""
        leaked = [b for b, c in enumerate(self.ref_counts) if c != 0]
        avail = list(self.free_blocks) + list(self.cache.evictable)
        if leaked or len(avail) != self.num_blocks or len(set(avail)) != self.num_blocks:
            raise AssertionError(f"KV block leak: {len(leaked)} blocks still referenced, "
                                 f"{len(self.free_blocks)} free + {self.cache.num_evictable} evictable "
                                 f"of {self.num_blocks}")
        if self._seq_hashes:
            raise AssertionError(f"prefix state left for seqs {sorted(self._seq_hashes)[:8]} (not freed)")
        if self.window_pool is not None:
            self.window_pool.check_no_leaks()

    def check_invariants(self, block_tables: Iterable[list[int]] | None = None) -> None:
        """The page table's consistency, AssertionError on the first break: free, evictable and referenced
        blocks partition all blocks with no duplicates; the hash table agrees with the hashes the blocks
        carry; free blocks carry none. With `block_tables` (every live sequence's table), each block's
        count must equal the number of times the tables hold it."""
        nb = self.num_blocks
        if len(self.ref_counts) != nb:
            raise AssertionError(f"{len(self.ref_counts)} ref counts for {nb} blocks")
        neg = [b for b, c in enumerate(self.ref_counts) if c < 0]
        if neg:
            raise AssertionError(f"negative ref counts on blocks {neg[:8]}")
        free = list(self.free_blocks)
        evictable = list(self.cache.evictable)
        if len(set(free)) != len(free):
            raise AssertionError("a block is on the free list twice")
        if len(set(evictable)) != len(evictable):
            raise AssertionError("a block is on the evictable list twice")
        free_set, ev_set = set(free), set(evictable)
        if free_set & ev_set:
            raise AssertionError(f"blocks both free and evictable: {sorted(free_set & ev_set)[:8]}")
        if not free_set <= set(range(nb)):
            raise AssertionError(f"free list holds unknown blocks {sorted(free_set - set(range(nb)))[:8]}")
        referenced = {b for b, c in enumerate(self.ref_counts) if c > 0}
        both = (free_set | ev_set) & referenced
        if both:
            raise AssertionError(f"blocks both free/evictable and referenced: {sorted(both)[:8]}")
        lost = set(range(nb)) - free_set - ev_set - referenced
        if lost:
            raise AssertionError(f"blocks neither free, evictable nor referenced: {sorted(lost)[:8]}")
        named_free = [b for b in free if self.cache.hash_of(b) is not None]
        if named_free:
            raise AssertionError(f"free blocks still carry a hash: {named_free[:8]}")
        self.cache.check(self.ref_counts)
        if not self.enable_prefix_caching and len(self.cache):
            raise AssertionError("prefix caching is off but blocks are cached")
        if block_tables is not None:
            held = Counter(b for t in block_tables for b in t)
            wrong = [(b, self.ref_counts[b], held.get(b, 0)) for b in range(nb)
                     if self.ref_counts[b] != held.get(b, 0)]
            if wrong:
                raise AssertionError("ref counts differ from the block tables (block, count, held): "
                                     f"{wrong[:8]}")
