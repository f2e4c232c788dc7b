"""Decode CUDA graphs and device sampling at the model runner, on a real GPU: what tests/unit/test_cuda_graph.py
and test_device_sampling.py check against a fake capture on CPU, here with torch.cuda.CUDAGraph, pinned
staging buffers and CUDA events as the staging fences. Passed on an H200 and an H100 (docs/gpu.md)."""
import torch

from tdpipe.config import ModelConfig
from tdpipe.core.engine_builder import random_weights
from tdpipe.sampling.device_sampler import DeviceSampler
from tdpipe.step_input import StepInput
from tdpipe.worker.cuda_graph import CudaGraphBackend, GraphSettings
from tdpipe.worker.model_runner import ModelRunner

DEVICE = "cuda"
HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 97, "hidden_size": 64,
      "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
      "tie_word_embeddings": False, "eos_token_id": 0}
BLOCK = 16
PROMPTS = [[5, 17, 60, 3, 9], [7, 7, 30], [11, 2, 90, 4, 4, 4, 8, 1, 2, 6, 6, 6, 6, 6, 6, 6, 6], [3], [40, 41]]


def runner(graphs: bool, backend=None) -> ModelRunner:
    weights = [(n, t * 10 if t.dim() == 2 else t) for n, t in random_weights(HF, seed=3)]
    return ModelRunner(ModelConfig.from_hf(HF), "", torch.float32, num_blocks=64, block_size=BLOCK, device=DEVICE,
                       weights=weights, graphs=GraphSettings((1, 2, 4, 8), max_model_len=256) if graphs else None,
                       graph_backend=backend)


def tables(lens: list[int]) -> list[list[int]]:
    return [list(range(i * 8, i * 8 + -(-n // BLOCK))) for i, n in enumerate(lens)]


def steps(k_max: int) -> list[StepInput]:
    lens = [len(p) for p in PROMPTS]
    out = [StepInput(0, [t for p in PROMPTS for t in p], lens, lens, tables(lens), True)]
    for k in range(1, k_max + 1):
        n = [m + k for m in lens]
        out.append(StepInput(k, [(k * 7 + i) % 97 for i in range(len(n))], [1] * len(n), n, tables(n), False))
    return out


def test_captured_decode_equals_eager_with_prep_running_ahead():
    """Five sequences (padded to 8), the prep of step k+1 staged before step k runs, as a stage's prep thread
    does: logits and KV cache equal eager execution."""
    eager, graph = runner(False), runner(True)
    assert graph.graphs is not None and sorted(graph.graphs.graphs) == [1, 2, 4, 8]
    if DEVICE == "cuda":
        assert isinstance(graph.graphs.backend, CudaGraphBackend)
    ss = steps(6)
    want = [eager.execute(eager.prepare(s)) for s in ss]
    got, staged = [], [graph.prepare(ss[0])]
    for s in ss[1:]:
        staged.append(graph.prepare(s))  # step k+1 staged before step k runs
        got.append(graph.execute(staged.pop(0)).clone())
    got.append(graph.execute(staged.pop(0)).clone())
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(graph.kv_cache, eager.kv_cache, rtol=1e-4, atol=1e-4)


def test_staged_steps_two_ahead_use_both_versions():
    """Two decode steps staged before either runs (both staging versions in flight), then run in order."""
    eager, graph = runner(False), runner(True)
    ss = steps(2)
    for r in (eager, graph):
        r.execute(r.prepare(ss[0]))
    a, b = graph.prepare(ss[1]), graph.prepare(ss[2])
    assert (a.graph.version, b.graph.version) == (0, 1)
    out = [graph.execute(a).clone(), graph.execute(b).clone()]
    for s, o in zip(ss[1:], out):
        torch.testing.assert_close(o, eager.execute(eager.prepare(s)), rtol=1e-4, atol=1e-4)


def test_device_sampling_on_the_gpu_is_seeded_and_keeps_to_likely_tokens():
    x = torch.full((2000, 97), -60.0, device=DEVICE)
    x[:, 3], x[:, 10] = 1.0, 0.0
    s = DeviceSampler()
    ids = s.sample(x, [1.0] * 2000, seed=5)
    assert ids.device.type == DEVICE and set(ids.tolist()) == {3, 10}
    assert abs((ids == 3).float().mean().item() - torch.sigmoid(torch.tensor(1.0)).item()) < 0.04
    assert torch.equal(s.sample(x, [1.0] * 2000, seed=5), ids)
    assert torch.equal(s.sample(x, [0.0] * 2000, seed=5), x.argmax(-1))
