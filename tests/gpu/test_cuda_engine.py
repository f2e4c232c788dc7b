"""The engine on CUDA through its public API: the platform, greedy parity with transformers in float32 (a
small random Llama with decisive logits, prompts across KV block boundaries), pp = 2 on the one GPU, prefix
caching. The bundled model's parity (fp32 and bf16) and the throughput are gpu-check's own steps."""
import random

import pytest
import torch

from tdpipe import LLM, SamplingParams
from tdpipe.bench.gpu_check import TINY_LLAMA
from tdpipe.bench.parity import hf_greedy

from gpu_models import decisive_model

LENGTHS = (5, 15, 16, 17, 33, 40)  # around the 16-token KV blocks
N = 16


@pytest.fixture(scope="module")
def decisive(tmp_path_factory):
    return decisive_model(tmp_path_factory.mktemp("decisive"), seed=0)


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, TINY_LLAMA["vocab_size"]) for _ in range(n)] for n in LENGTHS]


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_the_cuda_platform_is_chosen_and_describes_itself():
    from tdpipe.platforms import get_platform, resolve_device

    assert resolve_device("auto") == "cuda"
    p = get_platform("cuda")
    assert p.name == "cuda" and p.dist_backend == "nccl" and p.torch_device(0).type == "cuda"


def test_greedy_float32_equals_transformers(decisive):
    folder, hf = decisive
    prompts = _prompts()
    with LLM(folder, dtype="float32", device="cuda", kv_cache_memory=64 << 20) as llm:
        assert _generate(llm, prompts) == hf_greedy(hf, prompts, N)


def test_two_stages_on_one_gpu_equal_one(decisive):
    folder, _ = decisive
    prompts = _prompts()
    with LLM(folder, dtype="float32", device="cuda", kv_cache_memory=64 << 20) as llm:
        one = _generate(llm, prompts)
    with LLM(folder, dtype="float32", device="cuda", pipeline_parallel_size=2, kv_cache_memory=64 << 20) as llm:
        assert _generate(llm, prompts) == one


def test_prefix_caching_keeps_the_tokens(decisive):
    folder, hf = decisive
    shared = _prompts()[-1][:32]
    prompts = [shared + [7, 8, 9], shared + [10, 11]]
    with LLM(folder, dtype="float32", device="cuda", kv_cache_memory=64 << 20, enable_prefix_caching=True) as llm:
        first = _generate(llm, prompts[:1])
        both = _generate(llm, prompts)  # the second request reuses the cached 32-token prefix
    assert both[0] == first[0] and both == hf_greedy(hf, prompts, N)


def test_cuda_graphs_and_eager_give_the_same_tokens(decisive):
    folder, _ = decisive
    prompts = _prompts()  # 6 sequences: decode batches padded to the captured size 8
    with LLM(folder, dtype="float32", device="cuda", kv_cache_memory=64 << 20, enforce_eager=True) as llm:
        eager = _generate(llm, prompts)
    with LLM(folder, dtype="float32", device="cuda", kv_cache_memory=64 << 20) as llm:
        assert _generate(llm, prompts) == eager


def test_sampling_on_the_stage_equals_sampling_in_the_engine(decisive):
    folder, _ = decisive
    prompts = _prompts()
    params = SamplingParams(temperature=0.8, seed=None, max_tokens=N, ignore_eos=True)
    runs = {}
    for where in ("engine", "stage"):
        with LLM(folder, dtype="float32", device="cuda", kv_cache_memory=64 << 20, sampling_device=where) as llm:
            greedy = _generate(llm, prompts)
            sampled = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs[where] = greedy
        assert all(len(o.outputs[0].token_ids) == N for o in sampled)  # temperature rows sampled on the device
    assert runs["stage"] == runs["engine"]


def test_the_deferred_executor_at_depth_two_keeps_the_tokens(decisive):
    """pp = 1 on a GPU queues each step's device work (executor/local.py); with --pipeline-depth 2 a second
    micro-batch is queued behind the first. Greedy and seeded answers, logprobs included, equal depth 1's.
    Added after the 2026-11-30 H200 run (not yet run on a GPU); the CPU runs the same engine side deferred
    (tests/unit/test_local_executor.py)."""
    folder, hf = decisive
    prompts = _prompts()
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=N, ignore_eos=True, logprobs=1)
    runs = []
    for depth in (1, 2):
        with LLM(folder, dtype="float32", device="cuda", kv_cache_memory=64 << 20, pipeline_depth=depth) as llm:
            assert llm.engine.executor.asynchronous
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], seeded, use_tqdm=False)
            runs.append((_generate(llm, prompts), [list(o.outputs[0].token_ids) for o in outs]))
    assert runs[0] == runs[1] and runs[0][0] == hf_greedy(hf, prompts, N)
