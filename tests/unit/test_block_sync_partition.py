"""Pure checks of the pipeline's bookkeeping: block-table deltas (pipeline/wire/block_sync.py) and the layer
partition across stages (worker/partition.py). No processes, no model."""
import itertools
import random

import pytest

from tdpipe.config import ModelConfig
from tdpipe.pipeline.wire.block_sync import BlockTableMirror, BlockTableSender
from tdpipe.worker.partition import StageCosts, balanced_partition, resolve_partition

# --------------------------------------------------------------------------------------------- block sync


def _simulate(seed: int, steps: int = 400, pool: int = 24) -> None:
    """Engine-like random walk: sequences arrive, grow their tables while scheduled, get preempted (epoch
    += 1, table dropped and later rebuilt from scratch, often from the very same block ids) and finish.
    After every message the mirror must hold exactly the tables the engine sent, and nothing else."""
    rng = random.Random(seed)
    sender, mirror = BlockTableSender(), BlockTableMirror()
    tables: dict[int, list[int]] = {}  # live sequences: the engine's true table
    epochs: dict[int, int] = {}
    sent_truth: dict[int, tuple[int, list[int]]] = {}  # what the stage must hold for every sent live seq
    next_id = itertools.count()
    max_live = 0
    n_preempt = n_same_ids = n_finish = 0
    for _ in range(steps):
        # arrivals
        for _ in range(rng.choice([0, 0, 1, 2])):
            sid = next(next_id)
            tables[sid], epochs[sid] = [], 0
        live = list(tables)
        # preemptions happen between messages: the KV is dropped, the stages are not told
        for sid in live:
            if tables[sid] and rng.random() < 0.05:
                epochs[sid] += 1
                n_preempt += 1
                tables[sid] = []
        # finishes: released on the engine, announced to the stages with the next message
        done = [sid for sid in live if tables[sid] and rng.random() < 0.06]
        expect_freed = [sid for sid in done if sid in sent_truth]  # the stages only know what was sent
        for sid in done:
            del tables[sid], epochs[sid]
            sent_truth.pop(sid, None)
            n_finish += 1
        sender.release(done)
        # one micro-batch: a random subset of the live sequences, each with a table that grew (or not)
        live = list(tables)
        batch = rng.sample(live, k=rng.randint(0, min(len(live), 6)))
        for sid in batch:
            t = tables[sid]
            if not t:  # (re)built from scratch; after a preemption, often the same ids as before
                old = sent_truth.get(sid, (0, []))[1]
                if old and rng.random() < 0.5:
                    t.extend(old[: rng.randint(1, len(old))] if rng.random() < 0.5 else old)
                    if t == old[: len(t)]:
                        n_same_ids += 1
                else:
                    t.extend(rng.sample(range(pool), k=rng.randint(1, 4)))
            else:
                t.extend(rng.randrange(pool) for _ in range(rng.choice([0, 0, 0, 1, 2])))
        ids = batch
        deltas = sender.deltas(ids, [epochs[s] for s in ids], [list(tables[s]) for s in ids])
        for (ep, start, blocks), sid in zip(deltas, ids):
            assert ep == epochs[sid]
            assert blocks == tables[sid][start:]
        freed = sender.take_freed()
        assert freed == expect_freed
        out = mirror.apply(ids, deltas, freed)
        assert out == [tables[s] for s in ids]
        for sid in ids:
            sent_truth[sid] = (epochs[sid], list(tables[sid]))
        # every live sequence ever sent: the mirror holds what was last sent (stale only across preemption)
        assert {sid: (ep, t) for sid, (ep, t) in mirror.tables.items()} == sent_truth
        max_live = max(max_live, len(tables))
        assert len(mirror) <= len(tables) and len(sender) <= len(tables)
    # drain: finish everything; one more (empty) message carries the frees
    sender.release(list(tables))
    mirror.apply([], [], sender.take_freed())
    assert len(mirror) == 0 and len(sender) == 0
    assert sender.take_freed() == []
    # the walk actually exercised the interesting paths
    assert n_preempt >= 5 and n_same_ids >= 1 and n_finish >= 20 and max_live >= 5


@pytest.mark.parametrize("seed", range(12))
def test_block_sync_random_walk(seed):
    _simulate(seed)


def test_block_sync_sends_only_new_blocks():
    s, mir = BlockTableSender(), BlockTableMirror()
    d = s.deltas([7], [0], [[3, 4]])
    assert d == [(0, 0, [3, 4])]
    assert mir.apply([7], d, s.take_freed()) == [[3, 4]]
    d = s.deltas([7], [0], [[3, 4]])
    assert d == [(0, 2, [])]  # nothing new
    assert mir.apply([7], d, []) == [[3, 4]]
    d = s.deltas([7], [0], [[3, 4, 9]])
    assert d == [(0, 2, [9])]
    assert mir.apply([7], d, []) == [[3, 4, 9]]
    # preempted, rebuilt with the very same ids: a new epoch sends the whole table and replaces the copy
    d = s.deltas([7], [1], [[3, 4]])
    assert d == [(1, 0, [3, 4])]
    assert mir.apply([7], d, []) == [[3, 4]]
    assert mir.tables[7] == (1, [3, 4])
    # finished: freed goes out once, with the next message, and both sides forget the sequence
    s.release([7])
    s.release([7])  # twice is harmless
    s.release([123])  # never sent: nothing to tell the stages
    freed = s.take_freed()
    assert freed == [7]
    mir.apply([], [], freed)
    assert len(mir) == 0 and len(s) == 0 and s.take_freed() == []


def test_block_sync_delta_without_base_raises():
    mir = BlockTableMirror()
    with pytest.raises(RuntimeError, match="seq 5"):
        mir.apply([5], [(0, 3, [1])], [])  # mid-table delta for a sequence the stage never saw
    mir.apply([5], [(0, 0, [1, 2])], [])
    with pytest.raises(RuntimeError, match="seq 5"):
        mir.apply([5], [(0, 3, [9])], [])  # a message was lost: the stage holds 2 blocks, not 3
    with pytest.raises(RuntimeError, match="seq 5"):
        mir.apply([5], [(1, 1, [9])], [])  # new epoch but not from the start
    mir.apply([], [], [5])
    with pytest.raises(RuntimeError, match="seq 5"):
        mir.apply([5], [(0, 2, [9])], [])  # freed, then a stale delta


# --------------------------------------------------------------------------------------------- partition


def _cfg(num_layers: int = 30, **kw) -> ModelConfig:
    hf = dict(architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536,
              num_hidden_layers=num_layers, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
              rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192, vocab_size=49152,
              tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    hf.update(kw)
    return ModelConfig.from_hf(hf)


def _stage_costs(counts: list[int], c: StageCosts) -> list[float]:
    pp = len(counts)
    return [c.stage_cost(m, k == 0, k == pp - 1) for k, m in enumerate(counts)]


def _compositions(n: int, pp: int):
    """Every split of n layers into pp contiguous non-empty stages."""
    for cuts in itertools.combinations(range(1, n), pp - 1):
        bounds = (0,) + cuts + (n,)
        yield [b - a for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("seed", range(6))
def test_balanced_partition_is_optimal(seed):
    rng = random.Random(seed)
    for _ in range(8):
        n = rng.randint(2, 10)
        costs = StageCosts(embed=rng.uniform(0, 5), layer=rng.uniform(0.5, 3), head=rng.uniform(0, 12))
        cfg = _cfg(n)
        for pp in range(2, min(4, n) + 1):
            got = balanced_partition(cfg, pp, costs)
            assert len(got) == pp and sum(got) == n and all(m >= 1 for m in got), got
            brute = min(max(_stage_costs(s, costs)) for s in _compositions(n, pp))
            assert max(_stage_costs(got, costs)) == pytest.approx(brute, rel=1e-12), (n, pp, costs, got)
            # ties go to the most even split: least sum of squared stage costs among the optimal ones
            best_sq = min(sum(x * x for x in _stage_costs(s, costs)) for s in _compositions(n, pp)
                          if max(_stage_costs(s, costs)) <= brute * (1 + 1e-12))
            assert sum(x * x for x in _stage_costs(got, costs)) == pytest.approx(best_sq, rel=1e-9)


def test_balanced_partition_heavy_head_and_embed():
    # a head worth 4 layers: the last stage gets 4 fewer layers when the rest balances exactly
    assert balanced_partition(_cfg(12), 2, StageCosts(embed=0.0, layer=1.0, head=4.0)) == [8, 4]
    # free embedding and head: an even split
    assert balanced_partition(_cfg(12), 3, StageCosts(embed=0.0, layer=1.0, head=0.0)) == [4, 4, 4]
    # pp == 1: everything on one stage; pp == n: one layer each
    assert balanced_partition(_cfg(7), 1, StageCosts(1.0, 1.0, 1.0)) == [7]
    assert balanced_partition(_cfg(5), 5, StageCosts(1.0, 1.0, 100.0)) == [1] * 5


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_smollm2_default_costs(pp):
    cfg = _cfg()
    c = StageCosts.of(cfg)
    assert c.head > 3 * c.layer  # the tied 49152 x 576 lm_head is heavy on this model
    got = balanced_partition(cfg, pp)
    assert len(got) == pp and sum(got) == 30 and min(got) >= 1
    assert got[-1] < got[0], got  # the head's stage holds fewer layers
    even = [30 // pp + (1 if k < 30 % pp else 0) for k in range(pp)]
    assert max(_stage_costs(got, c)) <= max(_stage_costs(even, c))
    if pp == 2:
        assert max(_stage_costs(got, c)) < max(_stage_costs([15, 15], c))  # strictly better than 15/15
    # the resolved ranges are contiguous and cover every layer
    ranges = resolve_partition(cfg, pp, None)
    assert [b - a for a, b in ranges] == got
    assert ranges[0][0] == 0 and ranges[-1][1] == 30
    assert all(ranges[k][1] == ranges[k + 1][0] for k in range(pp - 1))


def test_resolve_partition_explicit():
    cfg = _cfg()
    assert resolve_partition(cfg, 2, [18, 12]) == [(0, 18), (18, 30)]
    assert resolve_partition(cfg, 3, [1, 28, 1]) == [(0, 1), (1, 29), (29, 30)]
    assert resolve_partition(cfg, 1, None) == [(0, 30)]


@pytest.mark.parametrize("pp, lp, needles", [
    (2, [10, 10, 10], ["[10, 10, 10]", "3 entries", "is 2"]),  # wrong length
    (3, [15, 15], ["[15, 15]", "2 entries", "is 3"]),
    (2, [30, 0], ["[30, 0]", "at least one layer"]),  # a stage without layers
    (2, [31, -1], ["[31, -1]"]),
    (2, [20, 5], ["[20, 5]", "sums to 25", "30"]),  # wrong sum
    (2, [20, 20], ["[20, 20]", "sums to 40"]),
])
def test_resolve_partition_errors(pp, lp, needles):
    with pytest.raises(ValueError) as e:
        resolve_partition(_cfg(), pp, lp)
    msg = str(e.value)
    assert "layer_partition" in msg
    for n in needles:
        assert n in msg, (n, msg)


def test_pp_exceeds_layers():
    with pytest.raises(ValueError) as e:
        resolve_partition(_cfg(4), 5, None)
    assert "5" in str(e.value) and "4 layers" in str(e.value)
    with pytest.raises(ValueError, match="31"):
        balanced_partition(_cfg(), 31)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size \(5\).*4 layers"):  # explicit split too
        resolve_partition(_cfg(4), 5, [1, 1, 1, 1, 0])
