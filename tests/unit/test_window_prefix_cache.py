"""Prefix caching with sliding-window layers (core/window_blocks.py, core/block_manager.py): pure Python.

A hit is the longest cached prefix valid for both pools: the global blocks, and the local blocks its next query
still reads (the last W tokens); local blocks out of the window are kept evictable, named like the global
block of the same index, and the local blocks before the window are never mapped."""
from tdpipe.core.block_manager import BlockManager
from tdpipe.core.prefix_cache import hash_block, iter_block_hashes
from tdpipe.core.window_blocks import NULL_BLOCK, WindowBlockPool
from tdpipe.sampling.params import SamplingParams
from tdpipe.sequence import Sequence

W, BS = 20, 4  # first_needed(p) = max(0, p - 19) // 4


def mkseq(i: int, tokens: list[int]) -> Sequence:
    return Sequence(i, str(i), list(tokens), SamplingParams(max_tokens=4), max_tokens=4)


def hashes(n: int) -> list[bytes]:
    return list(iter_block_hashes(list(range(1, 4 * n + 1)), BS))


def test_longest_valid_needs_every_block_of_the_window_before_the_reuse_point():
    wp = WindowBlockPool(40, BS, W)
    hs = hashes(10)

    def cached(idx):
        wp.reset()
        for i in idx:  # name block i+1 by hash i, as a commit would
            wp.cache.register(i + 1, hs[i])
        return wp.longest_valid(hs)

    assert cached(range(10)) == 10
    assert cached(range(5)) == 5  # k = 5 reads blocks 0..4; k = 6 would need block 5
    assert cached(range(3, 8)) == 8  # k = 8 reads blocks 3..7 only: 0..2 may be gone
    assert cached([0, 1, 2, 3, 4, 5, 7]) == 6  # block 6 missing: k = 7 and 8 need it, k = 6 reads 1..5
    assert cached([]) == 0 and cached([9]) == 0


def _prefill(bm: BlockManager, seq: Sequence, chunk: int = 8) -> int:
    """Chunked prefill as the hybrid policy runs it: commit and trim after each chunk."""
    cached = bm.cached_prefix_tokens(seq)
    assert bm.allocate_with_prefix(seq, min(seq.num_tokens, cached + chunk)) == cached
    seq.num_computed_tokens = cached
    while seq.num_computed_tokens < seq.num_tokens:
        n = min(seq.num_tokens, seq.num_computed_tokens + chunk)
        bm.allocate(seq, n)
        seq.num_computed_tokens = n
        bm.commit_full_blocks(seq)
        bm.trim_window(seq)
    return cached


def test_a_prefix_longer_than_the_window_is_reused_with_only_its_window_mapped():
    bm = BlockManager(64, BS, enable_prefix_caching=True, window=W, num_window_blocks=32)
    wp = bm.window_pool
    prefix = list(range(1, 61))  # 15 blocks, 3 windows
    a = mkseq(0, prefix + [99])
    assert _prefill(bm, a) == 0
    assert wp.live_blocks(a) <= -(-W // BS) + 1
    assert wp.cache.num_evictable > 0  # blocks out of the window are kept, named, not freed
    bm.free(a)
    bm.check_no_leaks()
    b = mkseq(1, prefix + [5, 6, 7])
    assert bm.window_fits(b, b.num_tokens, prefix=True)
    assert bm.allocate_with_prefix(b) == 60
    first = wp.first_needed(60)  # 10: blocks 10..14 hold positions 41..59, the window of position 60
    assert b.local_block_table[:first] == [NULL_BLOCK] * first
    assert all(x != NULL_BLOCK for x in b.local_block_table[first:])
    assert len(b.local_block_table) == len(b.block_table) == 16
    bm.check_invariants([b.block_table])
    bm.free(b)
    bm.check_no_leaks()


def test_the_hit_stops_where_the_window_pool_evicted_a_block():
    bm = BlockManager(64, BS, enable_prefix_caching=True, window=W, num_window_blocks=12)  # 11 local blocks
    wp = bm.window_pool
    prefix = list(range(1, 61))
    a = mkseq(0, prefix + [99])
    _prefill(bm, a)
    bm.free(a)
    # another sequence takes fresh local blocks: the pool evicts a's oldest first (LRU order of release)
    c = mkseq(2, [7] * 40)
    bm.allocate(c)
    bm.free(c)
    b = mkseq(1, prefix + [5])
    hits_global = len(bm.cache.table) and bm.find_cached_prefix(b.all_token_ids)
    got = _prefill(bm, b)
    assert got % BS == 0 and got < 60  # a's last window was evicted: not the whole 60 tokens
    k = got // BS
    assert len(hits_global) == k  # find_cached_prefix is cut to the window too
    for i in range(wp.first_needed(got), k):
        assert wp.cache.hash_of(b.local_block_table[i]) is not None
    bm.free(b)
    bm.check_no_leaks()


def test_no_hit_when_the_window_is_gone_and_counts_stay_right():
    bm = BlockManager(64, BS, enable_prefix_caching=True, window=W, num_window_blocks=8)  # 7 local blocks
    prefix = list(range(1, 41))
    a = mkseq(0, prefix + [99])
    _prefill(bm, a)
    bm.free(a)
    # evict every named local block
    fill = mkseq(3, [5] * (7 * BS))
    bm.allocate(fill)
    bm.free(fill)
    b = mkseq(1, prefix + [1])
    assert bm.cached_prefix_tokens(b) == 0 and bm.probe_cached_tokens(b) == 0
    assert _prefill(bm, b) == 0
    bm.free(b)
    bm.check_no_leaks()


def test_fork_and_hit_share_local_blocks_by_count():
    bm = BlockManager(64, BS, enable_prefix_caching=True, window=W, num_window_blocks=32)
    wp = bm.window_pool
    prefix = list(range(1, 33))
    a = mkseq(0, prefix + [1, 2])
    _prefill(bm, a)  # a keeps running: its window blocks stay referenced
    b = mkseq(1, prefix + [3])
    assert _prefill(bm, b) == 32
    shared = [x for x in b.local_block_table if x != NULL_BLOCK and x in a.local_block_table]
    assert shared and all(wp.ref_counts[x] == 2 for x in shared)
    bm.free(a)
    bm.free(b)
    bm.check_no_leaks()
    assert hash_block  # the names are the global chain's (core/prefix_cache.py)
