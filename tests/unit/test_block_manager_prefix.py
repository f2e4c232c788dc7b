"""Block manager with prefix caching, fork and copy-on-write (issue 15): unit tests, then hypothesis stateful
machines that drive random shared-prefix requests, forks, decodes with COW, frees and preemptions against a
simulated KV store, checking the page table's invariants after every step. Pure Python, no model."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tdpipe.core.block_manager import BlockManager
from tdpipe.core.prefix_cache import ROOT_HASH, hash_block, iter_block_hashes
from tdpipe.sampling.params import SamplingParams
from tdpipe.sequence import Sequence

BS = 4


def mkseq(i: int, tokens: list[int], outputs: list[int] | None = None) -> Sequence:
    s = Sequence(i, str(i), list(tokens), SamplingParams())
    s.output_token_ids = list(outputs or [])
    return s


def prefill(bm: BlockManager, s: Sequence, **kw) -> int:
    """Admit with the prefix cache, 'compute' every token, commit: what the engine will do for a prompt."""
    cached = bm.allocate_with_prefix(s, **kw)
    s.num_computed_tokens = s.num_tokens
    bm.commit_full_blocks(s)
    return cached


# -- hashing -------------------------------------------------------------------------------------------
def test_hash_is_chained_and_keyed():
    a = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert a == hash_block(ROOT_HASH, [1, 2, 3, 4]) and len(a) == 16
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(ROOT_HASH, [5, 6, 7, 8])  # same window, other prefix
    assert hash_block(ROOT_HASH, [1, 2, 3, 4], b"'lora-1'") != a
    chain = list(iter_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4))
    assert len(chain) == 2 and chain[0] == a and chain[1] == hash_block(a, [5, 6, 7, 8])
    with pytest.raises(ValueError, match="int64"):
        hash_block(ROOT_HASH, [2 ** 70])


def test_bad_extra_key_is_refused():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    with pytest.raises(TypeError, match="extra_key"):
        bm.find_cached_prefix([1, 2, 3, 4, 5], extra_key=[1])


# -- prefix hits -----------------------------------------------------------------------------------------
def test_hit_on_a_shared_prefix():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    sys_prompt = list(range(100, 110))  # 10 tokens: 2 full blocks + 2
    a = mkseq(0, sys_prompt + [1, 2, 3])
    assert prefill(bm, a) == 0
    assert bm.num_cached_blocks == 3  # 13 tokens computed: 3 full blocks, the 4th partial
    b = mkseq(1, sys_prompt + [7, 8, 9, 10, 11])
    assert bm.find_cached_prefix(b.all_token_ids) == a.block_table[:2]
    assert bm.prefix_plan(b) == (8, 2)  # 2 fresh blocks for 15 tokens, the cached ones are in use (free)
    cached = bm.allocate_with_prefix(b)
    assert cached == 8 and b.block_table[:2] == a.block_table[:2]
    assert [bm.ref_counts[x] for x in b.block_table] == [2, 2, 1, 1]
    assert bm.prefix_cache_hits == 8 and bm.prefix_cache_queries == 13 + 15
    assert bm.prefix_cache_hit_rate == pytest.approx(8 / 28)
    bm.check_invariants([a.block_table, b.block_table])
    bm.free(a)
    bm.free(b)
    bm.check_invariants([])
    bm.check_no_leaks()


def test_whole_prompt_cached_still_leaves_one_token():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    a = mkseq(0, list(range(8)))  # exactly 2 full blocks
    prefill(bm, a)
    assert bm.num_cached_blocks == 2
    b = mkseq(1, list(range(8)))
    assert bm.find_cached_prefix(b.all_token_ids) == a.block_table[:1]  # (8-1)//4 = 1 block at most
    assert bm.allocate_with_prefix(b) == 4 and b.num_tokens - 4 >= 1
    c = mkseq(2, list(range(9)))  # one more token: both full blocks may be used
    assert bm.allocate_with_prefix(c) == 8 and c.block_table[:2] == a.block_table
    for s in (a, b, c):
        bm.free(s)
    bm.check_no_leaks()


def test_partial_last_block_is_not_cached():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    a = mkseq(0, [1, 2, 3, 4, 5, 6])
    prefill(bm, a)
    assert bm.num_cached_blocks == 1
    bm.free(a)
    assert bm.num_evictable_blocks == 1 and len(bm.free_blocks) == 15  # the partial block went back free
    b = mkseq(1, [1, 2, 3, 4, 5, 6, 7])
    assert bm.allocate_with_prefix(b) == 4  # only the full block hits
    bm.free(b)


def test_only_computed_blocks_are_committed_and_outputs_count():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    a = mkseq(0, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    bm.allocate_with_prefix(a)
    assert bm.commit_full_blocks(a, 5) == 1  # a chunk of 5 computed: block 0 only
    assert bm.commit_full_blocks(a, 5) == 0  # idempotent
    assert bm.commit_full_blocks(a, 10) == 1
    a.output_token_ids += [11, 12]  # decode: output tokens fill block 2
    bm.append_slot(a)
    assert bm.commit_full_blocks(a, 12) == 1 and bm.num_cached_blocks == 3
    b = mkseq(1, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])  # a prompt equal to a's prompt + outputs
    assert bm.allocate_with_prefix(b) == 12
    with pytest.raises(ValueError, match="computed tokens"):
        bm.commit_full_blocks(a, 13)
    bm.free(a)
    bm.free(b)
    bm.check_no_leaks()


def test_duplicate_content_stays_uncached():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    a, b = mkseq(0, [1, 2, 3, 4, 5]), mkseq(1, [1, 2, 3, 4, 5])
    bm.allocate_with_prefix(a)
    bm.allocate_with_prefix(b)  # both before either commits: no hit, two physical copies
    a.num_computed_tokens = b.num_computed_tokens = 5
    assert bm.commit_full_blocks(a) == 1
    assert bm.commit_full_blocks(b) == 0  # its block 0 holds the same prefix: not a second table entry
    assert bm.num_cached_blocks == 1 and bm.cache.hash_of(b.block_table[0]) is None
    bm.check_invariants([a.block_table, b.block_table])
    bm.free(b)
    assert bm.num_evictable_blocks == 0  # b's copy went back to the free list
    bm.free(a)
    assert bm.num_evictable_blocks == 1
    bm.check_no_leaks()


def test_extra_key_partitions_the_cache():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    a = mkseq(0, list(range(9)))
    prefill(bm, a, extra_key=("lora", 1))
    b = mkseq(1, list(range(9)))
    assert bm.allocate_with_prefix(b) == 0
    c = mkseq(2, list(range(9)))
    assert bm.allocate_with_prefix(c, extra_key=("lora", 1)) == 8
    for s in (a, b, c):
        bm.free(s)
    bm.check_no_leaks()


# -- evictable blocks and LRU ------------------------------------------------------------------------------
def test_freed_cached_blocks_stay_findable_and_count_as_free():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = mkseq(0, list(range(9)))
    prefill(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0 and bm.usage() == 0
    assert bm.num_evictable_blocks == 2 and bm.num_cached_blocks == 2
    assert bm.can_allocate(mkseq(1, list(range(32))))  # 8 blocks: all, evicting the cached ones
    bm.check_invariants([])
    bm.check_no_leaks()


def test_cached_block_revived_from_evictable():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = mkseq(0, list(range(9)))
    prefill(bm, a)
    head = a.block_table[:2]
    bm.free(a)
    b = mkseq(1, list(range(9)))
    assert bm.prefix_plan(b) == (8, 3)  # 1 fresh + 2 revived: num_free_blocks drops by 3
    before = bm.num_free_blocks
    assert bm.allocate_with_prefix(b) == 8
    assert b.block_table[:2] == head and all(bm.ref_counts[x] == 1 for x in head)
    assert bm.num_evictable_blocks == 0 and bm.num_free_blocks == before - 3
    bm.check_invariants([b.block_table])
    bm.free(b)
    bm.check_no_leaks()


def test_lru_eviction_order():
    bm = BlockManager(6, BS, enable_prefix_caching=True)
    a = mkseq(0, [1] * 4 + [2] * 4 + [0])  # blocks a0 a1 + partial
    b = mkseq(1, [3] * 4 + [4] * 4 + [0])
    prefill(bm, a)
    prefill(bm, b)
    a0, a1 = a.block_table[:2]
    b0, b1 = b.block_table[:2]
    bm.free(a)  # LRU: a1, a0 (tail first)
    bm.free(b)  # then b1, b0
    assert list(bm.cache.evictable) == [a1, a0, b1, b0]
    assert len(bm.free_blocks) == 2
    c = mkseq(2, [9] * 12)  # 3 blocks: the 2 free ones, then evict a1 (oldest)
    bm.allocate_with_prefix(c)
    assert a1 in c.block_table and bm.cache.hash_of(a1) is None
    assert list(bm.cache.evictable) == [a0, b1, b0]
    d = mkseq(3, [1] * 4 + [2] * 4 + [0])  # a's prompt: block 0 still cached, block 1 evicted
    assert bm.find_cached_prefix(d.all_token_ids) == [a0]
    bm.allocate_with_prefix(d)  # revives a0, then needs 2 fresh: evicts b1, b0
    assert d.block_table[0] == a0 and bm.num_evictable_blocks == 0 and bm.num_cached_blocks == 1
    bm.check_invariants([c.block_table, d.block_table])
    bm.free(c)
    bm.free(d)
    bm.check_no_leaks()


def test_failed_allocation_takes_nothing():
    bm = BlockManager(3, BS, enable_prefix_caching=True)
    a = mkseq(0, list(range(9)))
    prefill(bm, a)
    bm.free(a)
    b = mkseq(1, list(range(16)) + [99])  # hits 2 cached blocks (revive 2) + 3 fresh > 3
    assert not bm.can_allocate_with_prefix(b)
    with pytest.raises(RuntimeError, match="KV blocks"):
        bm.allocate_with_prefix(b)
    assert b.block_table == [] and bm.num_evictable_blocks == 2 and bm.prefix_cache_queries == 9
    bm.check_invariants([])


def test_reset_clears_the_cache():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = mkseq(0, list(range(9)))
    prefill(bm, a)
    bm.reset()
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 8
    assert bm.find_cached_prefix(list(range(9))) == []
    bm.check_invariants([])
    bm.check_no_leaks()


def test_caching_off_is_the_old_manager():
    bm = BlockManager(8, BS)
    a = mkseq(0, list(range(9)))
    assert bm.allocate_with_prefix(a) == 0 and len(a.block_table) == 3
    a.num_computed_tokens = 9
    assert bm.commit_full_blocks(a) == 0 and bm.num_cached_blocks == 0
    assert bm.find_cached_prefix(list(range(9))) == []
    bm.free(a)
    assert len(bm.free_blocks) == 8 and bm.prefix_cache_hit_rate == 0.0
    bm.check_no_leaks()


def test_allocate_with_prefix_needs_an_empty_table():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = mkseq(0, list(range(5)))
    bm.allocate(a)
    with pytest.raises(ValueError, match="already holds"):
        bm.allocate_with_prefix(a)


# -- fork and copy-on-write ----------------------------------------------------------------------------------
def test_fork_and_copy_on_write():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    parent = mkseq(0, [1, 2, 3, 4, 5, 6], [7])  # 6 prompt tokens computed, a first token sampled
    bm.allocate_with_prefix(parent)
    parent.num_computed_tokens = 6
    bm.commit_full_blocks(parent)
    child = mkseq(1, [1, 2, 3, 4, 5, 6], [8])  # its own first sample
    bm.fork_seq(parent, child)
    p0, p1 = parent.block_table
    assert child.block_table == [p0, p1] and bm.ref_counts[p0] == 2 and bm.ref_counts[p1] == 2
    bm.check_invariants([parent.block_table, child.block_table])
    # the child writes position 6 (its token 8) into the shared partial block: copy first
    assert bm.can_append(child)
    assert bm.append_slot(child) == []
    free_before = bm.num_free_blocks
    src_dst = bm.prepare_append(child)
    assert src_dst is not None and src_dst[0] == p1
    dst = src_dst[1]
    assert child.block_table == [p0, dst] and dst != p1
    assert bm.ref_counts[p1] == 1 and bm.ref_counts[dst] == 1 and bm.ref_counts[p0] == 2
    assert bm.num_free_blocks == free_before - 1
    assert bm.prepare_append(parent) is None  # p1 is the parent's alone now: no copy
    assert bm.prepare_append(child) is None
    bm.check_invariants([parent.block_table, child.block_table])
    bm.free(parent)
    assert bm.ref_counts[p0] == 1  # still the child's
    bm.free(child)
    bm.check_no_leaks()


def test_forked_child_commits_under_the_parents_extra_key():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    parent = mkseq(0, [1, 2, 3, 4, 5, 6], [7])
    bm.allocate_with_prefix(parent, extra_key="lora-a")
    parent.num_computed_tokens = 6
    bm.commit_full_blocks(parent)
    child = mkseq(1, [1, 2, 3, 4, 5, 6], [8])
    bm.fork_seq(parent, child)
    child.num_computed_tokens = 6
    assert bm.prepare_append(child) is not None
    child.num_computed_tokens = 7
    child.output_token_ids.append(9)
    assert bm.commit_full_blocks(child, 8) == 1  # its private copy, now full: [5, 6, 8, 9]
    toks = [1, 2, 3, 4, 5, 6, 8, 9, 0]
    assert bm.find_cached_prefix(toks, extra_key="lora-a") == child.block_table[:2]
    assert bm.find_cached_prefix(toks) == []
    bm.free(parent)
    bm.free(child)
    bm.check_no_leaks()


def test_no_cow_when_unshared_or_block_full():
    bm = BlockManager(8, BS)
    a = mkseq(0, [1, 2, 3, 4, 5])
    bm.allocate(a)
    assert bm.prepare_append(a) is None
    parent = mkseq(1, [1, 2, 3], [4])  # 4 tokens: block 0 full after this step
    bm.allocate(parent)
    child = mkseq(2, [1, 2, 3], [4])
    bm.fork_seq(parent, child)
    parent.num_computed_tokens = child.num_computed_tokens = 4
    for s in (parent, child):
        s.output_token_ids.append(9)  # next write at position 4: a new block, no copy
        assert bm.append_slot(s) and bm.prepare_append(s) is None
    assert bm.ref_counts[parent.block_table[0]] == 2
    bm.check_invariants([a.block_table, parent.block_table, child.block_table])
    for s in (a, parent, child):
        bm.free(s)
    bm.check_no_leaks()


def test_can_append_counts_the_copy():
    bm = BlockManager(2, BS)
    parent = mkseq(0, [1, 2], [3])
    bm.allocate(parent)
    child = mkseq(1, [1, 2], [4])
    bm.fork_seq(parent, child)
    other = mkseq(2, [5])
    bm.allocate(other)  # no block left
    assert not bm.can_append(child)  # its write needs a private copy of the shared block
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.prepare_append(child)
    bm.free(other)
    assert bm.can_append(child)
    assert bm.prepare_append(child) is not None
    bm.free(parent)
    bm.free(child)
    bm.check_no_leaks()


def test_fork_errors():
    bm = BlockManager(8, BS)
    a = mkseq(0, [1, 2, 3])
    bm.allocate(a)
    with pytest.raises(ValueError, match="same seq_id"):
        bm.fork_seq(a, a)
    b = mkseq(1, [1])
    bm.allocate(b)
    with pytest.raises(ValueError, match="already holds"):
        bm.fork_seq(a, b)
    c = mkseq(2, [1, 2, 3])
    bm.fork_seq(a, c)
    c.output_token_ids += [4, 5]  # position 4 has no block yet
    with pytest.raises(RuntimeError, match="append_slot"):
        bm.prepare_append(c)


def test_double_free_still_raises_and_changes_nothing():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = mkseq(0, list(range(9)))
    prefill(bm, a)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(a)
    bm.check_invariants([])
    bm.check_no_leaks()


def test_check_invariants_catches_corruption():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = mkseq(0, list(range(9)))
    prefill(bm, a)
    with pytest.raises(AssertionError, match="ref counts differ"):
        bm.check_invariants([])  # a's table not reported
    bm.free_blocks.append(a.block_table[0])
    with pytest.raises(AssertionError, match="free/evictable and referenced"):
        bm.check_invariants()
    bm.free_blocks.pop()
    h = bm.cache.hash_of(a.block_table[0])
    bm.cache.table[h] = a.block_table[2]
    with pytest.raises(AssertionError, match="hash table"):
        bm.check_invariants()


# -- property-based: a random workload against a simulated KV store ----------------------------------------
PREFIXES = [[p * 100 + i for i in range(23)] for p in range(3)]  # shared "system prompts"


class PagedKVMachine(RuleBasedStateMachine):
    """Random requests sharing random prefixes, forks (n > 1), decodes with COW, frees, preemptions.

    `kv[block]` simulates each block's KV as the token ids written into its slots (None: never written since
    the block was taken). A write must go into a block that the writing sequence holds alone and that is not
    cached; a prefix hit must map blocks whose simulated KV equals the request's tokens: that is what makes
    a cached prefix give the same output as recomputing it."""

    CACHING = True
    NUM_BLOCKS = 24

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(self.NUM_BLOCKS, BS, enable_prefix_caching=self.CACHING)
        self.kv: dict[int, list[int | None]] = {}
        self.live: list[Sequence] = []
        self.waiting: list[Sequence] = []  # preempted, to be re-admitted
        self.next_id = 0
        self.rng = random.Random(0)

    # helpers
    def _new_blocks(self, blocks: list[int]) -> None:
        for b in blocks:
            if None not in self.kv.get(b, [None]):
                event("a block with KV reused (evicted or freed)")
            self.kv[b] = [None] * BS

    def _write(self, s: Sequence, lo: int, hi: int) -> None:
        toks = s.all_token_ids
        for p in range(lo, hi):
            b = s.block_table[p // BS]
            assert self.bm.ref_counts[b] == 1, f"seq {s.seq_id} writes shared block {b}"
            assert self.bm.cache.hash_of(b) is None, f"seq {s.seq_id} writes cached block {b}"
            self.kv[b][p % BS] = toks[p]
        s.num_computed_tokens = hi

    def _admit(self, s: Sequence) -> bool:
        """allocate_with_prefix + prefill of the rest + a sampled token + commit, as the engine will."""
        plan = self.bm.prefix_plan(s)
        free_before = self.bm.num_free_blocks
        if not self.bm.can_allocate_with_prefix(s):
            return False
        cached = self.bm.allocate_with_prefix(s)
        assert cached == plan.num_cached_tokens and cached % BS == 0 and cached < s.num_tokens
        event("prefix hit" if cached else "prefix miss")
        if any(self.bm.ref_counts[b] == 1 for b in s.block_table[:cached // BS]):
            event("hit revived a block")
        assert self.bm.num_free_blocks == free_before - plan.num_new_blocks
        toks = s.all_token_ids
        for i in range(cached // BS):  # the hit blocks hold exactly this request's tokens
            assert self.kv[s.block_table[i]] == toks[i * BS:(i + 1) * BS]
        self._new_blocks(s.block_table[cached // BS:])
        s.num_computed_tokens = cached
        self._write(s, cached, s.num_tokens)
        self.bm.commit_full_blocks(s)
        s.output_token_ids.append(self.rng.randrange(1000, 1010))
        self.live.append(s)
        return True

    def _preempt(self, s: Sequence) -> None:
        self.bm.free(s)
        s.reset_for_recompute()
        self.live.remove(s)
        self.waiting.append(s)

    # rules
    @initialize()
    def first_request(self) -> None:
        self.new_request(0, 23, 2, 0)

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), cut=st.integers(0, 23), suffix=st.integers(0, 9),
          outputs=st.integers(0, 3))
    def new_request(self, prefix: int, cut: int, suffix: int, outputs: int) -> None:
        toks = PREFIXES[prefix][:cut] + [self.rng.randrange(5000, 5003) for _ in range(suffix)]
        if not toks:
            toks = [7]
        s = Sequence(self.next_id, str(self.next_id), toks, SamplingParams())
        self.next_id += 1
        # a "prompt" can also carry earlier outputs (a resumed conversation): those hash alike
        s.output_token_ids = [self.rng.randrange(1000, 1003) for _ in range(outputs)]
        self._admit(s)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def readmit(self, data) -> None:
        s = self.waiting[data.draw(st.integers(0, len(self.waiting) - 1))]
        if self._admit(s):  # recompute: prompt and outputs so far prefilled again (minus any hit)
            self.waiting.remove(s)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def decode(self, data) -> None:
        s = self.live[data.draw(st.integers(0, len(self.live) - 1))]
        while not self.bm.can_append(s):
            victims = [v for v in self.live if v is not s]
            if not victims:
                self._preempt(s)
                return
            self._preempt(victims[-1])
        self._new_blocks(self.bm.append_slot(s))
        cow = self.bm.prepare_append(s)
        if cow is not None:
            src, dst = cow
            assert self.bm.ref_counts[src] >= 1 and self.bm.ref_counts[dst] == 1
            assert s.block_table[(s.num_tokens - 1) // BS] == dst
            self.kv[dst] = list(self.kv[src])  # the executor's block copy
            event("copy-on-write")
        assert s.num_computed_tokens == s.num_tokens - 1
        self._write(s, s.num_tokens - 1, s.num_tokens)
        self.bm.commit_full_blocks(s)
        s.output_token_ids.append(self.rng.randrange(1000, 1010))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(1, 3))
    def fork(self, data, n: int) -> None:
        parent = self.live[data.draw(st.integers(0, len(self.live) - 1))]
        for _ in range(n):
            child = Sequence(self.next_id, parent.request_id, list(parent.prompt_token_ids), SamplingParams())
            self.next_id += 1
            child.output_token_ids = list(parent.output_token_ids)
            child.output_token_ids[-1] = self.rng.randrange(1000, 1010)  # its own sample at the same position
            child.num_computed_tokens = parent.num_computed_tokens
            self.bm.fork_seq(parent, child)
            self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data) -> None:
        s = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        self.bm.free(s)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt(self, data) -> None:
        self._preempt(self.live[data.draw(st.integers(0, len(self.live) - 1))])

    @precondition(lambda self: self.waiting)
    @rule()
    def abort_waiting(self) -> None:
        self.waiting.pop(0)  # no blocks held: nothing to free

    # checks
    @invariant()
    def page_table_consistent(self) -> None:
        self.bm.check_invariants([s.block_table for s in self.live])
        assert self.bm.num_used_blocks == len({b for s in self.live for b in s.block_table})
        for s in self.live:
            assert len(s.block_table) * BS >= s.num_tokens - 1
        for h, b in self.bm.cache.table.items():  # a cached block's KV is complete
            assert None not in self.kv[b], f"cached block {b} has unwritten slots"

    @invariant()
    def live_kv_matches_tokens(self) -> None:
        for s in self.live:
            toks = s.all_token_ids
            for p in range(s.num_computed_tokens):
                assert self.kv[s.block_table[p // BS]][p % BS] == toks[p], (s.seq_id, p)

    def teardown(self) -> None:
        for s in self.live:
            self.bm.free(s)
        self.live.clear()
        self.bm.check_invariants([])
        self.bm.check_no_leaks()


class PagedKVMachineNoCache(PagedKVMachine):
    CACHING = False


class PagedKVMachineTight(PagedKVMachine):
    NUM_BLOCKS = 9  # constant pressure: evictions and preemptions on most steps


_settings = settings(max_examples=100, stateful_step_count=40, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestPagedKV = PagedKVMachine.TestCase
TestPagedKV.settings = _settings
TestPagedKVNoCache = PagedKVMachineNoCache.TestCase
TestPagedKVNoCache.settings = settings(_settings, max_examples=40)
TestPagedKVTight = PagedKVMachineTight.TestCase
TestPagedKVTight.settings = _settings
