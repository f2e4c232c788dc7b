"""Block manager: allocation, growth, ref counts, double free, no leaks (pure Python, no model)."""
import random

import pytest

from tdpipe.core.block_manager import BlockManager
from tdpipe.sampling.params import SamplingParams
from tdpipe.sequence import Sequence


def seq(i: int, n: int) -> Sequence:
    return Sequence(i, str(i), list(range(1, n + 1)), SamplingParams())


def test_allocate_rounds_up_to_blocks():
    bm = BlockManager(10, 4)
    s = seq(0, 9)
    assert bm.can_allocate(s)
    new = bm.allocate(s)
    assert len(new) == 3 and s.block_table == new
    assert bm.num_free_blocks == 7 and bm.usage() == pytest.approx(0.3)


def test_append_slot_allocates_only_at_block_boundary():
    bm = BlockManager(10, 4)
    s = seq(0, 4)
    bm.allocate(s)
    s.output_token_ids.append(5)  # 5 tokens -> second block needed
    assert bm.append_slot(s) and len(s.block_table) == 2
    s.output_token_ids.append(6)
    assert bm.append_slot(s) == [] and len(s.block_table) == 2


def test_capacity_and_reserve():
    bm = BlockManager(4, 4)
    a, b = seq(0, 12), seq(1, 8)
    bm.allocate(a)
    assert not bm.can_allocate(b)
    assert bm.can_allocate(seq(2, 4)) and not bm.can_allocate(seq(2, 4), reserve=1)
    with pytest.raises(RuntimeError):
        bm.allocate(b)
    assert bm.num_free_blocks == 1  # failed allocation took nothing


def test_double_free_is_an_error():
    bm = BlockManager(4, 4)
    s = seq(0, 5)
    bm.allocate(s)
    table = list(s.block_table)
    bm.free(s)
    s.block_table = table
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(s)


def test_ref_counts_share_blocks():
    bm = BlockManager(4, 4)
    a = seq(0, 8)
    bm.allocate(a)
    b = seq(1, 8)
    b.block_table = bm.fork(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 2  # still referenced by b
    bm.free(b)
    bm.check_no_leaks()


def test_random_workload_never_leaks():
    rng = random.Random(0)
    bm = BlockManager(64, 16)
    live: list[Sequence] = []
    for i in range(2000):
        if live and rng.random() < 0.3:
            s = live.pop(rng.randrange(len(live)))
            bm.free(s)
        elif rng.random() < 0.5 and live:
            s = rng.choice(live)
            s.output_token_ids.append(1)
            if bm.can_append(s):
                bm.append_slot(s)
            else:
                live.remove(s)
                bm.free(s)
        else:
            s = seq(i, rng.randint(1, 100))
            if bm.can_allocate(s):
                bm.allocate(s)
                live.append(s)
        used = sum(len(x.block_table) for x in live)
        assert used == bm.num_used_blocks
        if i % 50 == 0:
            bm.check_invariants([x.block_table for x in live])
        for x in live:
            assert len(x.block_table) * 16 >= x.num_tokens
    for s in live:
        bm.free(s)
    bm.check_no_leaks()


def test_writes_in_place_is_the_case_where_appending_changes_nothing():
    """The scheduler's fast path: True exactly when append_slot and prepare_append would leave the table and
    the counts as they are (a private, uncached block with room); a new block, a shared block (after a fork)
    and an empty sequence take the general path."""
    bm = BlockManager(10, 4)
    s = seq(0, 6)
    bm.allocate(s)  # 6 tokens in 2 blocks: the next decode writes position 5, block 1, alone
    assert bm.writes_in_place(s)
    before = (list(s.block_table), list(bm.ref_counts), bm.num_free_blocks)
    assert bm.append_slot(s) == [] and bm.prepare_append(s) is None
    assert (list(s.block_table), list(bm.ref_counts), bm.num_free_blocks) == before
    s.output_token_ids += [7, 8, 9]  # 9 tokens: position 8 needs a third block
    assert not bm.writes_in_place(s)
    bm.append_slot(s)
    assert bm.writes_in_place(s)
    twin = seq(1, 9)
    twin.block_table = bm.fork(s.block_table)  # the block it writes is now shared: copy-on-write
    assert not bm.writes_in_place(s) and not bm.writes_in_place(twin)
    assert not bm.writes_in_place(Sequence(2, "2", [], SamplingParams()))
