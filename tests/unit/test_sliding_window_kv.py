"""The sliding-window layers' own KV pool (core/window_blocks.py, core/kv_pools.py): pure Python, no model.

A sequence's local blocks are counted between steps through a prefill and a long decode (never more than
ceil(W / block_size) + 1), freed on finish, abort and preemption, shared and copied on fork; the two pools
are sized from the budget."""
import pytest

from tdpipe.config import ModelConfig, SchedulerConfig
from tdpipe.core.block_manager import BlockManager
from tdpipe.core.kv_pools import KVPools, layer_block_bytes, size_kv_pools
from tdpipe.core.scheduler import make_scheduler
from tdpipe.core.window_blocks import NULL_BLOCK, WindowBlockPool
from tdpipe.sampling.params import SamplingParams
from tdpipe.sequence import Sequence

W, BS = 20, 4
BOUND = -(-W // BS) + 1  # 6


def mkseq(i: int, prompt: int, out: int) -> Sequence:
    return Sequence(i, str(i), [1 + i] * prompt, SamplingParams(max_tokens=out), max_tokens=out)


def run(sched, bm, seqs, check=None, max_steps=20_000):
    """Fake executor: token 7 for every sampled row; `check(batch)` after every step (between steps)."""
    for s in seqs:
        sched.add(s)
    steps = 0
    finished = []
    while sched.has_unfinished():
        batch = sched.schedule()
        steps += 1
        assert steps < max_steps, "no progress"
        if batch is None:
            continue
        step = batch.step_input()
        assert len(step.local_block_tables) == len(batch.seqs)
        for s, n, lt in zip(batch.seqs, batch.num_new_tokens, step.local_block_tables):
            # every position this step writes or reads (its window) has a live local block
            first = max(0, s.num_computed_tokens - W + 1) // BS
            last = (s.num_computed_tokens + n - 1) // BS
            assert len(lt) == len(s.block_table) and all(b != NULL_BLOCK for b in lt[first:last + 1])
        finished += sched.update_from_output(batch, [7] * len(batch.sampled_rows()))
        for s in sched.running:
            assert bm.window_pool.live_blocks(s) <= BOUND, (s.seq_id, s.local_block_table)
        if check is not None:
            check(batch)
    return finished


def make(policy="separate", num_blocks=200, window_blocks=64, max_seqs=4, budget=64, max_len=256):
    bm = BlockManager(num_blocks, BS, window=W, num_window_blocks=window_blocks)
    cfg = SchedulerConfig(policy=policy, max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_len)
    return make_scheduler(cfg, bm), bm


def test_local_blocks_bounded_through_prefill_and_long_decode():
    sched, bm = make()
    seqs = [mkseq(i, 30 + 7 * i, 120) for i in range(3)]  # each sequence several windows long
    done = run(sched, bm, seqs)
    assert len(done) == 3 and all(len(s.output_token_ids) == 120 for s in done)
    assert all(len(s.local_block_table) == 0 for s in done)
    bm.check_no_leaks()
    # the whole prompt (up to 44 tokens = 11 blocks) is held while its prefill runs, at most BOUND after
    assert bm.window_pool.peak_used <= 3 * -(-44 // BS)


def test_chunked_prefill_holds_window_plus_chunk():
    sched, bm = make("hybrid", num_blocks=100, window_blocks=1 + 2 * BOUND + 2, max_seqs=2, budget=8)
    seqs = [mkseq(0, 150, 40), mkseq(1, 90, 30)]  # prompts far longer than the local pool
    done = run(sched, bm, seqs)
    assert len(done) == 2
    bm.check_no_leaks()
    assert bm.window_pool.peak_used <= bm.window_pool.num_blocks - 1


def test_pool_frees_on_finish_abort_and_preemption():
    # a local pool for about two sequences' windows: a third one is preempted (or waits) and all finish
    sched, bm = make(num_blocks=400, window_blocks=1 + 2 * BOUND + 12, max_seqs=4)
    seqs = [mkseq(i, 40, 60) for i in range(4)]
    done = run(sched, bm, seqs)
    assert len(done) == 4
    bm.check_no_leaks()
    # abort frees both pools
    s = mkseq(8, 30, 10)
    sched.add(s)
    batch = sched.schedule()
    sched.update_from_output(batch, [7] * len(batch.sampled_rows()))
    assert s.local_block_table and s.block_table
    from tdpipe.sequence import SequenceStatus

    s.status = SequenceStatus.FINISHED
    sched.abort(s)
    bm.check_no_leaks()
    # preemption frees both pools
    s = mkseq(9, 30, 10)
    bm.allocate(s)
    assert bm.window_pool.live_blocks(s) == -(-30 // BS) and len(s.block_table) == 8
    s.num_computed_tokens = 30
    bm.trim_window(s)
    assert bm.window_pool.live_blocks(s) <= BOUND
    bm.free(s)
    assert s.local_block_table == [] and s.block_table == []
    bm.check_no_leaks()


def test_preemption_under_a_tight_local_pool():
    # global blocks plenty, local pool for ~2 windows: decodes run out of local blocks and preempt
    sched, bm = make(num_blocks=400, window_blocks=1 + 11 + BOUND + 1, max_seqs=4, budget=64)
    seqs = [mkseq(i, 10, 80) for i in range(4)]
    done = run(sched, bm, seqs)
    assert len(done) == 4 and all(len(s.output_token_ids) == 80 for s in done)
    assert sched.num_preemptions >= 1
    bm.check_no_leaks()


def test_fork_shares_then_copies_on_write():
    bm = BlockManager(50, BS, window=W, num_window_blocks=30)
    parent = mkseq(0, 26, 10)
    bm.allocate(parent)
    parent.num_computed_tokens = 26
    bm.trim_window(parent)
    parent.output_token_ids.append(5)
    child = Sequence(1, "1", list(parent.prompt_token_ids), SamplingParams(), max_tokens=10)
    child.output_token_ids.append(6)
    child.num_computed_tokens = 26
    bm.fork_seq(parent, child)
    assert child.local_block_table == parent.local_block_table
    assert bm.can_append(child)
    bm.append_slot(child)
    assert bm.prepare_append(child) is not None  # the shared partial last block, global pool
    cow = bm.prepare_append_window(child)  # and local pool, numbered past the global one
    assert cow is not None and cow[0] >= bm.num_blocks and cow[1] >= bm.num_blocks
    assert child.local_block_table[-1] == cow[1] - bm.num_blocks != parent.local_block_table[-1]
    bm.free(parent)
    bm.free(child)
    bm.check_no_leaks()


def test_no_window_pool_is_the_plain_block_manager():
    a, b = BlockManager(10, 4), BlockManager(10, 4, window=None, num_window_blocks=99)
    assert a.window_pool is None and b.window_pool is None
    s, t = mkseq(0, 9, 4), mkseq(0, 9, 4)
    a.allocate(s)
    b.allocate(t)
    assert s.block_table == t.block_table and s.local_block_table == t.local_block_table == []
    assert s.block_table and mkseq(1, 1, 1).local_block_table == []
    from tdpipe.core.batch import Batch

    assert Batch(0, [s], [9], True).step_input().local_block_tables == []


def test_window_pool_refuses_when_short_and_changes_nothing():
    bm = BlockManager(100, BS, window=W, num_window_blocks=5)  # 4 usable local blocks
    s = mkseq(0, 30, 1)
    assert not bm.can_allocate(s)
    with pytest.raises(RuntimeError):
        bm.allocate(s)
    assert s.block_table == [] and s.local_block_table == [] and bm.num_free_blocks == 100
    assert bm.window_pool.num_free_blocks == 4
    with pytest.raises(ValueError):
        WindowBlockPool(1, BS, W)


def cfg_of(windows: list[int | None]) -> ModelConfig:
    return ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": len(windows), "num_attention_heads": 4,
                                "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 4096,
                                "rms_norm_eps": 1e-6})


def with_windows(windows: list[int | None]) -> ModelConfig:
    cfg = cfg_of(windows)
    cfg.layer_windows = list(windows)
    return cfg


def test_pools_sized_from_the_budget():
    bs, dt, max_len = 16, 2, 4096
    glob = with_windows([None] * 6)
    per = layer_block_bytes(glob, bs, dt)
    budget = 1000 * 6 * per  # 1000 all-layer blocks
    assert size_kv_pools(glob, budget, bs, dt, max_len, max_len, 8) == KVPools(1000, capacity_tokens=16000)
    gemma = with_windows([512] * 5 + [None])  # five local layers, one global
    p = size_kv_pools(gemma, budget, bs, dt, max_len, 512, 8)  # chunked prefill, 512-token steps
    ng, nl = p.num_blocks, p.num_window_blocks
    assert ng * per + nl * 5 * per <= budget and p.window == 512 and p.capacity_tokens == ng * bs
    assert nl == 1 + (-(-(512 + 511) // bs) + 1) + 8 * (512 // bs + 1)  # a step and 8 windows: never binds
    assert ng > 2 * 1000  # the rest: more than twice the tokens all-global layers would hold
    # whole-prompt prefill: the local pool holds a whole max-length prompt beside the windows
    q = size_kv_pools(gemma, budget, bs, dt, max_len, max_len, 8)
    assert q.num_window_blocks == 1 + max_len // bs + 8 * 33 and q.num_blocks >= q.num_window_blocks
    assert q.num_blocks * per + q.num_window_blocks * 5 * per <= budget
    # a budget where that local pool would outgrow the global one: equal pools, as all-global
    tiny = size_kv_pools(gemma, 100 * 6 * per, bs, dt, max_len, max_len, 8)
    assert tiny.num_window_blocks == tiny.num_blocks + 1 == 100 and tiny.capacity_tokens == 99 * bs
    # a window as long as max_model_len frees nothing: one pool, as without local layers
    assert size_kv_pools(gemma, budget, bs, dt, 512, 512, 8) == KVPools(1000, capacity_tokens=16000)
    # all local (Mistral): the whole budget is the local pool; the global table only counts
    mistral = with_windows([512] * 6)
    m = size_kv_pools(mistral, budget, bs, dt, max_len, 512, 8)
    assert m.num_window_blocks == 1000 and m.num_blocks >= 8 * max_len // bs and m.capacity_tokens == max_len
    short = size_kv_pools(mistral, 100 * 6 * per, bs, dt, max_len, max_len, 8)  # whole prompts: 99 blocks
    assert short.capacity_tokens == 99 * bs


def test_block_sync_carries_local_tables_to_the_stages():
    """The local tables travel as deltas like the global ones: the stage's copy agrees on every block the
    window can read (entries given back keep their old id there, never read); fork copies resend it whole."""
    from tdpipe.pipeline.wire.block_sync import BlockTableMirror, BlockTableSender

    sched, bm = make(num_blocks=200, window_blocks=40)
    send, mirror = BlockTableSender(), BlockTableMirror()
    for s in [mkseq(0, 23, 50), mkseq(1, 9, 70)]:
        sched.add(s)
    while sched.has_unfinished():
        batch = sched.schedule()
        step = batch.step_input()
        deltas = send.deltas(step.seq_ids, step.kv_epochs, step.local_block_tables)
        tables = mirror.apply(step.seq_ids, deltas, [])
        for s, t in zip(batch.seqs, tables):
            first = max(0, s.num_computed_tokens - W + 1) // BS
            assert len(t) == len(s.local_block_table) and t[first:] == s.local_block_table[first:]
        done = sched.update_from_output(batch, [7] * len(batch.sampled_rows()))
        send.forget([s.seq_id for s in done])
    assert len(send) == 0
    bm.check_no_leaks()
