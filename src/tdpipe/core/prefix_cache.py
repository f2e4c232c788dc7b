"""Automatic prefix caching: content hashes of full KV blocks, the hash -> block table, the evictable LRU.

The lecture (001 §3.3) frames PagedAttention as OS paging: a block table maps a sequence's logical blocks to
physical ones, and a physical block can sit in several tables at once so requests share cached tokens. Prefix
caching finds those shared blocks by content: a full block is named by a hash of (its parent block's hash, its
token ids, an extra key), so two blocks with equal hashes hold the KV of equal *prefixes*, not merely of equal
16-token windows (the KV of a token depends on every token before it). Only full blocks are named: a partial
block is still being written.

A named block whose last reference goes away keeps its KV and stays findable, but it is *evictable*: the block
manager takes it back (oldest first, LRU) only when it needs a fresh block and the free list is empty;
eviction drops its name. This module holds that state; reference counts, the free list and sequences stay in
`BlockManager`, which calls it.

Hash choice: blake2b with a 128-bit digest over a fixed-layout encoding (parent digest, length-prefixed extra
key, tokens as little-endian int64). Python's `hash()` of a tuple would be faster, but it is 64-bit and not
collision resistant: token ids come from users, small ints hash to themselves and tuple hashing is a simple
mix, so two prompts could be crafted to collide, and a collision means a request silently reads another
prompt's KV (wrong output, and a leak between requests). With 128 bits an accidental collision among even 1e9
cached blocks has probability ~1e-21. The digest is also stable across processes (no PYTHONHASHSEED), so every
pipeline stage or a restarted engine would compute the same names.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Union

BlockHash = bytes
HASH_BYTES = 16
ROOT_HASH: BlockHash = bytes(HASH_BYTES)  # parent of a sequence's first block

# What may key a cache partition besides the tokens (a LoRA id, an image digest, a tenant salt): values whose
# repr() is deterministic and injective, so the encoding below is too.
ExtraKey = Union[None, int, str, bytes, tuple]


def _check_extra_key(key: object) -> None:
    if key is None or isinstance(key, (int, str, bytes)):
        return
    if isinstance(key, tuple):
        for k in key:
            _check_extra_key(k)
        return
    raise TypeError(f"extra_key must be None, int, str, bytes or a tuple of them, got {type(key).__name__}")


def encode_extra_key(key: ExtraKey) -> bytes:
    """A stable byte encoding of `key` (the repr of a literal-only value parses back to it: injective)."""
    _check_extra_key(key)
    return b"" if key is None else repr(key).encode()


def hash_block(parent: BlockHash, tokens: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Name of a full block: blake2b(parent digest | len(extra) | extra | tokens as int64).

    `extra` is `encode_extra_key(...)`, encoded once per sequence rather than once per block."""
    if len(parent) != HASH_BYTES:
        raise ValueError(f"parent hash must be {HASH_BYTES} bytes, got {len(parent)}")
    try:
        body = struct.pack(f"<{len(tokens)}q", *tokens)
    except struct.error as e:
        raise ValueError(f"token ids must be ints in the int64 range: {e}") from None
    h = hashlib.blake2b(parent, digest_size=HASH_BYTES)
    h.update(struct.pack("<I", len(extra)))
    h.update(extra)
    h.update(body)
    return h.digest()


def iter_block_hashes(token_ids: Sequence[int], block_size: int, extra: bytes = b"", *,
                      start: int = 0, parent: BlockHash = ROOT_HASH,
                      max_blocks: int | None = None) -> Iterator[BlockHash]:
    """Chained hashes of the full blocks start, start+1, ... of `token_ids` (`parent`: hash of block start-1).

    Lazy, so a lookup that misses early stops hashing early."""
    end = len(token_ids) // block_size
    if max_blocks is not None:
        end = min(end, max_blocks)
    for i in range(start, end):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra)
        yield parent


class PrefixCache:
    """Hash -> block table, each block's own hash, and the evictable blocks in LRU order (oldest first).

    Invariant kept with `BlockManager`: a block is in the table iff it carries a hash, and it is evictable iff
    it carries a hash and no sequence references it."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.table: dict[BlockHash, int] = {}
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.evictable: OrderedDict[int, None] = OrderedDict()  # insertion order = LRU order

    def __len__(self) -> int:
        """Number of cached (hashed) blocks, referenced or evictable."""
        return len(self.table)

    @property
    def num_evictable(self) -> int:
        return len(self.evictable)

    def lookup(self, h: BlockHash) -> int | None:
        return self.table.get(h)

    def hash_of(self, block: int) -> BlockHash | None:
        return self.block_hash[block]

    def register(self, block: int, h: BlockHash) -> bool:
        """Name `block` by `h`. False (block left unnamed) when another block already holds that content, so
        the table never has two blocks for one prefix; an already-named block must keep its name."""
        cur = self.block_hash[block]
        if cur is not None:
            if cur != h:
                raise RuntimeError(f"KV block {block} is cached under another hash: its content changed "
                                   "after it was full (a cached block must never be written)")
            return True
        if h in self.table:
            return False
        self.table[h] = block
        self.block_hash[block] = h
        return True

    def add_evictable(self, block: int) -> None:
        """`block` (named) lost its last reference: newest in LRU order."""
        if self.block_hash[block] is None:
            raise RuntimeError(f"KV block {block} has no hash: it belongs on the free list, not the LRU")
        if block in self.evictable:
            raise RuntimeError(f"KV block {block} is already evictable (double free)")
        self.evictable[block] = None

    def revive(self, block: int) -> None:
        """An evictable block got a reference again (prefix hit): off the LRU, keeping its name and KV."""
        del self.evictable[block]

    def evict_lru(self) -> int:
        """Take the least recently freed evictable block and drop its name: it will be overwritten."""
        if not self.evictable:
            raise RuntimeError("no evictable KV block")
        block, _ = self.evictable.popitem(last=False)
        h = self.block_hash[block]
        assert h is not None and self.table.get(h) == block, f"evictable block {block} not in the hash table"
        del self.table[h]
        self.block_hash[block] = None
        return block

    def clear(self) -> None:
        self.table.clear()
        self.block_hash = [None] * self.num_blocks
        self.evictable.clear()

    def check(self, ref_counts: Sequence[int]) -> None:
        """The cache's own invariants against the manager's ref counts; AssertionError on the first break."""
        for h, b in self.table.items():
            if not 0 <= b < self.num_blocks:
                raise AssertionError(f"hash table points at block {b}, outside 0..{self.num_blocks - 1}")
            if self.block_hash[b] != h:
                raise AssertionError(f"hash table entry for block {b} does not match the hash it carries")
        named = sum(1 for h in self.block_hash if h is not None)
        if named != len(self.table):
            raise AssertionError(f"{named} blocks carry a hash but the table has {len(self.table)} entries")
        for b in self.evictable:
            if self.block_hash[b] is None:
                raise AssertionError(f"evictable block {b} carries no hash")
            if ref_counts[b] != 0:
                raise AssertionError(f"evictable block {b} is referenced ({ref_counts[b]})")
