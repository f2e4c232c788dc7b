"""Decode steps as captured graphs (worker/cuda_graph.py), everything but the capture itself: a fake backend
records the stage's forward and replays it on the static buffers. The sizes, the padding to the next
captured size, the eager fallbacks, the versioned staging buffers (one an in-flight step reads is never
rewritten), and outputs and KV cache equal to eager execution on a tiny random-weight model."""
import threading

import pytest
import torch

from tdpipe.config import ModelConfig
from tdpipe.core.engine_builder import random_weights
from tdpipe.step_input import StepInput
from tdpipe.worker.cuda_graph import (DecodeGraphs, FakeGraphBackend, GraphSettings, StagingRing, capture_sizes,
                                      default_sizes, graph_settings)
from tdpipe.worker.model_runner import ModelRunner

HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 97, "hidden_size": 32,
      "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
      "eos_token_id": 0}
BLOCK = 4
SETTINGS = GraphSettings((1, 2, 4, 8), max_model_len=64)


def make_runner(graphs: bool, start: int = 0, end: int | None = None, versions: int = 2):
    """The tiny model (weights scaled up so logits differ), eager or with fake-captured decode graphs."""
    weights = [(n, t * 10 if t.dim() == 2 else t) for n, t in random_weights(HF, seed=3)]
    backend = FakeGraphBackend() if graphs else None
    settings = GraphSettings(SETTINGS.sizes, SETTINGS.max_model_len, versions) if graphs else None
    r = ModelRunner(ModelConfig.from_hf(HF), "", torch.float32, num_blocks=48, block_size=BLOCK, start_layer=start,
                    end_layer=end, weights=weights, graphs=settings, graph_backend=backend)
    return r, backend


PROMPTS = [[5, 17, 60, 3, 9], [7, 7, 30], [11, 2, 90, 4, 4, 4, 8, 1, 2], [3], [40, 41], [50, 2, 2, 9],
           [8, 8], [1, 2, 3, 4], [6, 6, 6]]


def tables(lens: list[int], width: int = 8) -> list[list[int]]:
    """Sequence i owns blocks [i * width, i * width + blocks needed)."""
    return [list(range(i * width, i * width + -(-n // BLOCK))) for i, n in enumerate(lens)]


def prefill(n: int) -> StepInput:
    ps = PROMPTS[:n]
    lens = [len(p) for p in ps]
    return StepInput(0, [t for p in ps for t in p], lens, lens, tables(lens, 5), True)


def decode(batch_id: int, n: int, k: int) -> StepInput:
    """The k-th decode step (k >= 1) of the first n prompts."""
    lens = [len(p) + k for p in PROMPTS[:n]]
    return StepInput(batch_id, [(batch_id * 7 + i) % 97 for i in range(n)], [1] * n, lens, tables(lens, 5), False)


# ------------------------------------------------------------------------------------------------- sizes
def test_default_sizes_pad_by_at_most_seven_rows_up_to_the_cap():
    d = default_sizes(256)
    assert d[:5] == [1, 2, 4, 8, 16] and d[-1] == 256 and len(d) == 35
    assert all(b - a <= 8 for a, b in zip(d, d[1:]))
    assert default_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_sizes(1000)[-1] == 256
    assert capture_sizes([8, 3, 1, 600, 3], 256) == [1, 3, 8, 256]
    assert capture_sizes(None, 12) == [1, 2, 4, 8, 12]


def test_graph_settings_off_without_graphs_or_with_enforce_eager():
    assert graph_settings(False, False, None, 64, 512) is None  # cpu
    assert graph_settings(True, True, None, 64, 512) is None  # --enforce-eager
    s = graph_settings(True, False, [4, 1], 64, 512)
    assert s.sizes == (1, 4) and s.max_model_len == 512


def test_cpu_runner_stays_eager_without_an_injected_backend():
    weights = list(random_weights(HF, seed=3))
    r = ModelRunner(ModelConfig.from_hf(HF), "", torch.float32, num_blocks=8, block_size=BLOCK, weights=weights,
                    graphs=SETTINGS)
    assert r.graphs is None


# ---------------------------------------------------------------------------------- padding and fallbacks
def test_capture_runs_largest_first_and_writes_nothing_to_the_cache():
    r, backend = make_runner(graphs=True)
    assert backend.captures == [8, 4, 2, 1]
    assert not r.kv_cache.any()  # every captured row was padding: slot -1


def test_steps_pad_to_the_next_size_and_the_rest_runs_eagerly():
    r, _ = make_runner(graphs=True)
    g = r.graphs
    assert [g.size_for(decode(1, n, 1)) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert g.size_for(decode(1, 9, 1)) is None  # above the largest size
    assert g.size_for(prefill(3)) is None
    chunk = StepInput(1, [1, 2], [2], [9], [[0, 1, 2]], False)  # two new tokens over a cached prefix
    assert g.size_for(chunk) is None
    wide = decode(1, 1, 1)
    wide.block_tables = [list(range(17))]  # wider than max_model_len 64 / 4 = 16 blocks
    assert g.size_for(wide) is None
    assert r.prepare(prefill(3)).graph is None and r.prepare(decode(1, 3, 1)).graph is not None


def test_padded_rows_write_nowhere_and_attend_one_token_even_after_a_fuller_step():
    r, _ = make_runner(graphs=True, versions=1)
    g = r.graphs
    full = g.stage(decode(1, 4, 1), 4)
    g.run(full)  # rows 0..3 real: the static buffers now hold real slots
    part = g.stage(decode(2, 3, 2), 4)
    h = g.staging[part.version]
    lens = [len(p) + 2 for p in PROMPTS[:3]]
    assert h.slots[3] == -1 and h.seq_lens[3] == 1 and h.positions[3] == 0 and h.block_tables[3, 0] == 0
    assert h.seq_lens[:3].tolist() == lens and h.positions[:3].tolist() == [n - 1 for n in lens]
    want = [t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for t, n in zip(tables(lens, 5), lens)]
    assert h.slots[:3].tolist() == want
    g.run(part)
    assert g.static.slots[3] == -1 and g.static.seq_lens[3] == 1


# ------------------------------------------------------------------------------------ equal to eager
def _compare(n_seqs: int, steps: int):
    eager, _ = make_runner(graphs=False)
    graph, backend = make_runner(graphs=True)
    for r in (eager, graph):
        r.execute(r.prepare(prefill(n_seqs)))
    for k in range(1, steps + 1):
        step = decode(k, n_seqs, k)
        a = eager.execute(eager.prepare(step))
        inp = graph.prepare(step)
        b = graph.execute(inp)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        assert b.shape == (n_seqs, HF["vocab_size"])
    torch.testing.assert_close(graph.kv_cache, eager.kv_cache, rtol=1e-5, atol=1e-5)
    return backend


def test_graph_decode_equals_eager_logits_and_kv_cache():
    backend = _compare(n_seqs=3, steps=4)
    assert backend.replays == [4] * 4  # 3 rows padded to the captured 4


def test_oversize_batches_run_eagerly_and_still_agree():
    backend = _compare(n_seqs=9, steps=2)
    assert backend.replays == []


def test_a_later_stage_takes_hidden_states():
    """A slice after the first (layer 1 of 2): hidden states in (each run its own copy: the eager layers
    add into their input in place, as into a stage's receive buffer)."""
    eager, _ = make_runner(graphs=False, start=1)
    graph, backend = make_runner(graphs=True, start=1)
    gen = torch.Generator().manual_seed(0)
    pre = prefill(3)
    hidden = torch.randn(pre.num_tokens, HF["hidden_size"], generator=gen)
    for r in (eager, graph):
        r.execute(r.prepare(pre), hidden.clone())
    step = decode(1, 3, 1)
    h = torch.randn(3, HF["hidden_size"], generator=gen)
    a = eager.execute(eager.prepare(step), h.clone())
    b = graph.execute(graph.prepare(step), h.clone())
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_a_stage_before_the_last_returns_a_copy_of_the_static_output():
    """Its hidden states go to a sender thread and outlive the next replay of the same graph."""
    eager, _ = make_runner(graphs=False, end=1)
    graph, _ = make_runner(graphs=True, end=1)
    for r in (eager, graph):
        r.execute(r.prepare(prefill(3)))
    step = decode(1, 3, 1)
    a = eager.execute(eager.prepare(step))
    b = graph.execute(graph.prepare(step))
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    static = graph.graphs.graphs[4].output
    assert b.shape == (3, HF["hidden_size"]) and b.untyped_storage().data_ptr() != static.untyped_storage().data_ptr()


# --------------------------------------------------------------------------------------- versioning
class _Fence:
    def __init__(self) -> None:
        self.waited = False

    def wait(self) -> None:
        self.waited = True


def test_ring_alternates_versions_blocks_when_all_are_held_and_waits_for_the_fence():
    ring = StagingRing(2, lambda f: f.wait())
    assert [ring.acquire(), ring.acquire()] == [0, 1]
    with pytest.raises(TimeoutError):
        ring.acquire(timeout=0.01)
    fence = _Fence()
    ring.release(0, fence)
    assert not fence.waited
    assert ring.acquire() == 0 and fence.waited  # rewritten only once the copy that read it is done
    ring.release(0, None)
    with pytest.raises(RuntimeError, match="not held"):
        ring.release(0, None)


def test_a_staged_step_is_never_overwritten_while_in_flight():
    """Prep runs ahead of compute: steps A and B staged (two versions); staging C waits until A has been
    copied to the device, and takes A's version, never B's. Every result equals eager."""
    eager, _ = make_runner(graphs=False)
    graph, _ = make_runner(graphs=True, versions=2)
    for r in (eager, graph):
        r.execute(r.prepare(prefill(3)))
    steps = [decode(k, 3, k) for k in (1, 2, 3)]
    g = graph.graphs
    a = graph.prepare(steps[0])
    snapshot = [t.clone() for t in g.staging[a.graph.version].parts()]
    b = graph.prepare(steps[1])
    assert (a.graph.version, b.graph.version) == (0, 1)
    assert all(torch.equal(x, y) for x, y in zip(snapshot, g.staging[0].parts()))  # B wrote elsewhere
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("c", graph.prepare(steps[2])))
    t.start()
    t.join(0.2)
    assert t.is_alive() and "c" not in got  # both versions in flight: C waits
    outs = [graph.execute(a)]
    t.join(5)
    assert got["c"].graph.version == 0
    outs += [graph.execute(b), graph.execute(got["c"])]
    for step, out in zip(steps, outs):
        torch.testing.assert_close(out, eager.execute(eager.prepare(step)), rtol=1e-5, atol=1e-5)
    assert g.ring.held == set()


@pytest.mark.triton
def test_graph_decode_over_the_triton_kernels_equals_eager():
    """The GPU's attention path (the Triton kernels, run by Triton's interpreter) behind a graph: static
    block tables as wide as max_model_len, padded rows skipped by the KV store, one token for padding."""
    from tdpipe.model import paged_attention as pa

    pa.set_attention_backend("triton")
    try:
        eager, _ = make_runner(graphs=False)
        weights = [(n, t * 10 if t.dim() == 2 else t) for n, t in random_weights(HF, seed=3)]
        graph = ModelRunner(ModelConfig.from_hf(HF), "", torch.float32, num_blocks=48, block_size=BLOCK,
                            weights=weights, graphs=GraphSettings((4,), max_model_len=64),
                            graph_backend=FakeGraphBackend())
        for r in (eager, graph):
            r.execute(r.prepare(prefill(3)))
        step = decode(1, 3, 1)
        b = graph.execute(graph.prepare(step))
        torch.testing.assert_close(b, eager.execute(eager.prepare(step)), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(graph.kv_cache, eager.kv_cache, rtol=1e-5, atol=1e-5)
    finally:
        pa.set_attention_backend("auto")


@pytest.mark.parametrize("backend", ["auto", pytest.param("triton", marks=pytest.mark.triton)])
@pytest.mark.parametrize("start,end", [(0, None), (0, 1), (1, None)], ids=["whole", "first", "last"])
def test_warm_up_runs_every_step_kind_and_writes_nothing(backend: str, start: int, end: int | None):
    """The start-up warm-up (run on CUDA before capture, so Triton compiles the eager variants then): a prefill,
    a mixed step and an eager decode on every kind of slice, the KV cache left as it was, and the runner's
    real steps afterwards unchanged."""
    from tdpipe.model import paged_attention as pa

    pa.set_attention_backend(backend)
    try:
        r, _ = make_runner(graphs=False, start=start, end=end)
        fresh, _ = make_runner(graphs=False, start=start, end=end)
        r.warm_up()
        assert not r.kv_cache.any()
        hidden = None if start == 0 else torch.randn(sum(len(p) for p in PROMPTS[:3]), HF["hidden_size"])
        a = r.execute(r.prepare(prefill(3)), None if hidden is None else hidden.clone())  # (norms work in place)
        b = fresh.execute(fresh.prepare(prefill(3)), None if hidden is None else hidden.clone())
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(r.kv_cache, fresh.kv_cache, rtol=0, atol=0)
    finally:
        pa.set_attention_backend("auto")
