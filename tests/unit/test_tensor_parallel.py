"""Megatron-style sharding without processes: T ranks as threads over a gloo group in this process.

The sharded model (q/k/v and gate/up by column, o and down by row with one all-reduce each, vocabulary-
parallel embedding and lm_head, KV cache by KV heads) must compute what the unsharded one does (float32,
tight tolerance), including uneven splits (SmolLM2's 9 query / 3 KV heads at T = 2, an odd MLP width), and
each rank must hold only its shard. The runtime around it is tested in test_tensor_parallel_runtime.py.
"""
import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from tdpipe.config import ModelConfig
from tdpipe.model.tensor_parallel import SINGLE, ProcessGroupTP, greedy_ids, head_split, shard_range
from tdpipe.pipeline.wire.groups import GLOO, gloo_options, new_group
from tdpipe.step_input import StepInput
from tdpipe.worker.model_runner import ModelRunner

BLOCK = 4


# ------------------------------------------------------------------------------------------- pure helpers

def test_shard_range_covers_evenly():
    for n, tp in [(10, 3), (9, 2), (151936, 2), (4, 4), (97, 2)]:
        parts = [shard_range(n, tp, r) for r in range(tp)]
        assert parts[0][0] == 0 and parts[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
        sizes = [b - a for a, b in parts]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_head_split_follows_gqa_groups():
    s = head_split(9, 3, 2)  # SmolLM2 at T = 2
    assert [(h.q_start, h.q_count, h.kv_start, h.kv_count) for h in s] == [(0, 6, 0, 2), (6, 3, 2, 1)]
    s = head_split(14, 2, 2)  # Qwen2.5-0.5B
    assert [(h.q_count, h.kv_count) for h in s] == [(7, 1), (7, 1)]
    # more ranks than KV heads: each KV head replicated, its group's query heads split among its copies
    s = head_split(4, 1, 2)  # Gemma 3 270M at T = 2
    assert [(h.q_start, h.q_count, h.kv_start, h.kv_count) for h in s] == [(0, 2, 0, 1), (2, 2, 0, 1)]
    s = head_split(8, 2, 4)
    assert [(h.q_start, h.q_count, h.kv_start, h.kv_count) for h in s] == [(0, 2, 0, 1), (2, 2, 0, 1),
                                                                          (4, 2, 1, 1), (6, 2, 1, 1)]
    with pytest.raises(ValueError, match=r"tensor_parallel_size 4 cannot share 3 KV heads \(9 query heads\)"):
        head_split(9, 3, 4)


# ------------------------------------------------------------------------------------------- thread ranks

def _groups(size: int) -> list[ProcessGroupTP]:
    """The stage's group as the pipeline builds it (pipeline/wire/groups.py's new_group), on gloo."""
    store = dist.HashStore()
    timeout = datetime.timedelta(seconds=60)
    opts = gloo_options(True, timeout)
    out: list = [None] * size

    def make(r: int) -> None:
        out[r] = ProcessGroupTP(new_group(GLOO, dist.PrefixStore("tp", store), r, size, opts, timeout), r, size)

    ts = [threading.Thread(target=make, args=(r,)) for r in range(size)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def _on_ranks(size: int, fn):
    """fn(group) on every rank, each in its own thread; returns the results by rank (re-raises errors)."""
    groups = _groups(size)
    res: list = [None] * size
    errs: list = []

    def run(r: int) -> None:
        try:
            res[r] = fn(groups[r])
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    ts = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    if errs:
        raise errs[0]
    return res


def test_collectives_bf16_and_uneven_gather():
    def fn(g):
        x = torch.full((3, 4), 1.0 + g.rank, dtype=torch.bfloat16)
        g.all_reduce_(x)
        y = g.all_gather(torch.full((2, 1 + g.rank), float(g.rank)), dim=1)
        return x, y, g.comm_seconds

    out = _on_ranks(3, fn)
    for x, y, secs in out:
        assert x.dtype == torch.bfloat16 and torch.equal(x, torch.full((3, 4), 6.0, dtype=torch.bfloat16))
        assert torch.equal(y, torch.tensor([[0.0, 1, 1, 2, 2, 2]] * 2)) and secs > 0


def test_greedy_ids_ties_go_to_the_lowest_id():
    full = torch.randn(5, 11)
    full[0, 2] = full[0, 9] = 100.0  # a tie across the two shards: the lower id wins, as torch.argmax
    full[1, 7] = 50.0

    def fn(g):
        a, b = shard_range(11, 2, g.rank)
        return greedy_ids(full[:, a:b], a, g)

    for ids in _on_ranks(2, fn):
        assert ids.tolist() == full.argmax(-1).tolist() and ids[0] == 2


# ------------------------------------------------------------------------------------------- models

def _save(tmp_path, kind: str) -> tuple[str, ModelConfig]:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if kind == "qwen2":  # biases on q/k/v, untied lm_head, 4 / 2 heads
        cfg = Qwen2Config(vocab_size=301, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                          tie_word_embeddings=False, initializer_range=0.2)
        m = Qwen2ForCausalLM(cfg)
        with torch.no_grad():
            for layer in m.model.layers:
                for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    p.bias.normal_(0, 0.2)
    else:  # SmolLM2's head shape (9 / 3, uneven at T = 2), tied embeddings, odd MLP width and vocabulary
        cfg = LlamaConfig(vocab_size=301, hidden_size=72, intermediate_size=97, num_hidden_layers=2,
                          num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=128,
                          tie_word_embeddings=True, initializer_range=0.2)
        m = LlamaForCausalLM(cfg)
    m.save_pretrained(tmp_path)
    return str(tmp_path), ModelConfig.from_hf(cfg.to_dict())


def _steps():
    """A prefill of two prompts, then one decode step of both (block tables of 4-token blocks)."""
    a, b = [5, 17, 200, 3, 9, 41], [7, 7, 300]
    tables = [[0, 1], [2]]
    pre = StepInput(0, a + b, [6, 3], [6, 3], tables, True)
    dec = StepInput(1, [11, 12], [1, 1], [7, 4], [[0, 1], [2, 3]], False)
    return pre, dec


def _run(folder, cfg, tp=SINGLE):
    r = ModelRunner(cfg, folder, torch.float32, num_blocks=8, block_size=BLOCK, tp=tp)
    outs = []
    for step in _steps():
        logits = r.execute(r.prepare(step))
        outs.append((logits, r.greedy(logits)))
    params = sum(p.numel() for p in r.model.parameters())
    return outs, params, r.kv_cache.shape, r.model.vocab_range


@pytest.mark.parametrize("kind,tp", [("qwen2", 2), ("llama_uneven", 2), ("llama_uneven", 3)])
def test_sharded_model_matches_unsharded(tmp_path, kind, tp):
    folder, cfg = _save(tmp_path, kind)
    ref, ref_params, ref_kv, _ = _run(folder, cfg)
    ranks = _on_ranks(tp, lambda g: _run(folder, cfg, g))
    for k, (ref_logits, ref_ids) in enumerate(ref):
        shards = [r[0][k][0] for r in ranks]
        assert [tuple(r[3]) for r in ranks] == [shard_range(cfg.vocab_size, tp, t) for t in range(tp)]
        torch.testing.assert_close(torch.cat(shards, dim=1), ref_logits, rtol=1e-5, atol=1e-5)
        for r in ranks:  # every rank agrees on the greedy ids, equal to the unsharded argmax
            assert r[0][k][1].tolist() == ref_ids.tolist()
    # each rank holds only its shard: together about the unsharded parameters (norms replicated)
    total = sum(r[1] for r in ranks)
    norms = cfg.hidden_size * (2 * cfg.num_layers + 1)
    assert total - (tp - 1) * norms == ref_params
    assert all(r[1] < ref_params for r in ranks)
    hs = head_split(cfg.num_heads, cfg.num_kv_heads, tp)
    assert [r[2][3] for r in ranks] == [h.kv_count for h in hs] and ref_kv[3] == cfg.num_kv_heads


def test_each_rank_reads_only_its_slices(tmp_path, monkeypatch):
    """The loader asks safetensors for slices (get_slice), never the whole tensor, for sharded weights."""
    from tdpipe.model import weights

    folder, cfg = _save(tmp_path, "qwen2")
    seen: list[tuple[str, tuple]] = []
    orig = weights.iter_safetensors

    def spy(*a, **kw):
        for name, t in orig(*a, **kw):
            seen.append((name, tuple(t.shape)))
            yield name, t

    monkeypatch.setattr("tdpipe.model.awq.iter_safetensors", spy)  # read_checkpoint reads through it
    _on_ranks(2, lambda g: ModelRunner(cfg, folder, torch.float32, num_blocks=2, block_size=BLOCK, tp=g))
    shapes = dict(seen)  # both ranks' shapes are equal here (even split)
    assert shapes["model.embed_tokens.weight"] == (151, 48) or shapes["model.embed_tokens.weight"] == (150, 48)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (24, 48)
    assert shapes["model.layers.0.self_attn.q_proj.bias"] == (24,)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (48, 24)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (48, 40)
    assert shapes["model.norm.weight"] == (48,)
