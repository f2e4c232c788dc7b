"""Weights and memory between generate calls on CUDA (core/weight_sync.py): update_weights from a folder and
from tensors with decode CUDA graphs on (they must be captured again: a replay reads the parameters it was
captured with), and sleep / wake_up giving the GPU memory back. Two decisive random Llamas of one shape, each
checked against its transformers twin."""
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tdpipe import LLM, SamplingParams
from tdpipe.bench.gpu_check import TINY_LLAMA
from tdpipe.bench.parity import hf_greedy

from gpu_models import decisive_model

N = 12
KV = 256 << 20


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """(folder A, folder B, A's oracle tokens, B's oracle tokens) over six prompts (decode padded to graph 8)."""
    rng = random.Random(1)
    prompts = [[rng.randrange(3, TINY_LLAMA["vocab_size"]) for _ in range(n)] for n in (4, 9, 16, 17, 30, 41)]
    a, hf_a = decisive_model(tmp_path_factory.mktemp("a"), seed=0)
    b, hf_b = decisive_model(tmp_path_factory.mktemp("b"), seed=1)
    ta, tb = hf_greedy(hf_a, prompts, N), hf_greedy(hf_b, prompts, N)
    assert ta != tb
    return prompts, a, b, ta, tb


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_update_weights_recaptures_the_decode_graphs(two):
    prompts, a, b, ta, tb = two
    with LLM(a, dtype="float32", device="cuda", kv_cache_memory=KV, enable_prefix_caching=True) as llm:
        assert _greedy(llm, prompts) == ta
        assert llm.update_weights(b) == 1
        assert _greedy(llm, prompts) == tb  # stale graphs would still compute A
        tensors = [kv for f in sorted(Path(a).glob("*.safetensors")) for kv in load_file(f).items()]
        llm.update_weights(iter(tensors))
        assert _greedy(llm, prompts) == ta


def test_sleep_gives_the_gpu_memory_back(two):
    prompts, a, b, ta, tb = two
    with LLM(a, dtype="float32", device="cuda", kv_cache_memory=KV) as llm:
        assert _greedy(llm, prompts) == ta
        awake = torch.cuda.memory_allocated()
        llm.sleep(1)
        kv_freed = awake - torch.cuda.memory_allocated()
        llm.wake_up()
        assert _greedy(llm, prompts) == ta
        llm.sleep(2)
        all_freed = awake - torch.cuda.memory_allocated()
        llm.wake_up()
        assert _greedy(llm, prompts) == ta
        llm.update_weights(b)
        assert _greedy(llm, prompts) == tb
    assert kv_freed >= KV * 0.9, f"sleep(1) gave back {kv_freed >> 20} MiB of a {KV >> 20} MiB cache"
    assert all_freed > kv_freed, "sleep(2) kept the weights"
