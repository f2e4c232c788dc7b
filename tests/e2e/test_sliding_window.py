"""Sliding-window layers with their own KV pool (core/window_blocks.py), against transformers.

Random in-memory configs with a 20-token window and 4-token blocks, sequences several windows long: greedy
tokens equal transformers', the local pool's use stays bounded, and a prompt longer than an all-global cache
of the same memory runs (chunked prefill)."""
import functools

import pytest
import torch

from conftest import hf_greedy
from tdpipe.config import CacheConfig, EngineConfig, SchedulerConfig
from tdpipe.core.engine import LLMEngine
from tdpipe.core.engine_builder import random_weights
from tdpipe.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

W, BS = 20, 4
BOUND = -(-W // BS) + 1
MISTRAL = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 97, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 512, "sliding_window": W, "rms_norm_eps": 1e-6, "eos_token_id": 0,
           "tie_word_embeddings": False}
GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 97, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "query_pre_attn_scalar": 16, "max_position_embeddings": 512, "sliding_window": W,
          "layer_types": ["sliding_attention", "sliding_attention", "full_attention"], "rms_norm_eps": 1e-6,
          "eos_token_id": 0, "tie_word_embeddings": True}


N_OUT = 48
PROMPT_LENS = (45, 7, 26)  # with N_OUT tokens: 55 .. 93 positions, 3-5 windows


def prompts_of(seed: int, lens=PROMPT_LENS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 97, (n,), generator=g).tolist() for n in lens]


@functools.cache
def reference(name: str, prompt: tuple[int, ...], n: int) -> list[int]:
    """transformers' greedy tokens (each computed once for the module)."""
    return hf_greedy(hf_model_of(name), list(prompt), n)


@functools.cache
def hf_model_of(name: str):
    return hf_model({"mistral": MISTRAL, "gemma3": GEMMA3}[name], 3)


def hf_model(hf: dict, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(hf["model_type"], **{k: v for k, v in hf.items() if k != "model_type"})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    missing, unexpected = model.load_state_dict(dict(random_weights(hf, seed)), strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    return model


def engine(hf: dict, num_blocks: int, policy: str = "separate", budget: int | None = None,
           caching: bool = True) -> LLMEngine:
    cfg = EngineConfig(dtype="float32", seed=0,
                       cache=CacheConfig(block_size=BS, num_blocks=num_blocks, enable_prefix_caching=caching),
                       scheduler=SchedulerConfig(policy=policy, max_num_seqs=4, max_model_len=256,
                                                 max_num_batched_tokens=budget))
    return LLMEngine.from_config(cfg, hf_config=hf, seed=3)


def generate(eng: LLMEngine, prompts: list[list[int]], n: int, check=None, samples: int = 1) -> list[list[int]]:
    """Greedy tokens of each prompt; `samples` > 1: that many samples of each (forked: shared blocks, then
    copy-on-write in both pools), listed one after the other."""
    p = SamplingParams(n=samples, temperature=0.0, max_tokens=n, ignore_eos=True)
    for i, ids in enumerate(prompts):
        eng.add_request(str(i), ids, p)
    out: dict[tuple[str, int], list[int]] = {(str(i), k): [] for i in range(len(prompts)) for k in range(samples)}
    while eng.has_unfinished():
        for d in eng.step():
            out[d.request_id, d.index] += d.new_token_ids
        if check is not None:
            check(eng)
    eng.block_manager.check_no_leaks()
    return [out[str(i), k] for i in range(len(prompts)) for k in range(samples)]


def bounded(eng: LLMEngine) -> None:
    """Between steps, every running sequence holds at most ceil(W / bs) + 1 local blocks."""
    wp = eng.block_manager.window_pool
    for s in eng.scheduler.running:
        assert wp.live_blocks(s) <= BOUND, (s.seq_id, s.local_block_table)


@pytest.mark.parametrize("hf", [MISTRAL, GEMMA3], ids=["mistral", "gemma3"])
def test_greedy_parity_several_windows_long_with_bounded_local_blocks(hf):
    prompts = prompts_of(5)
    eng = engine(hf, num_blocks=200)
    wp = eng.block_manager.window_pool
    assert wp is not None and wp.window == W
    assert eng.block_manager.enable_prefix_caching  # a cache per pool (tests below)
    outs = generate(eng, prompts, N_OUT, bounded, samples=2)
    name = "mistral" if hf is MISTRAL else "gemma3"
    for i, p in enumerate(prompts):
        assert outs[2 * i] == outs[2 * i + 1] == reference(name, tuple(p), N_OUT)
    # the whole prompts' blocks while the prefill runs, a window each afterwards
    assert wp.peak_used <= sum(-(-len(p) // BS) for p in prompts) + len(prompts)


def test_greedy_parity_when_the_local_pool_preempts():
    prompts = prompts_of(5)
    eng = engine(MISTRAL, num_blocks=18, policy="hybrid", budget=16)  # 17 local blocks for three sequences
    outs = generate(eng, prompts, N_OUT, bounded)
    assert eng.scheduler.num_preemptions >= 1
    for p, o in zip(prompts, outs):
        assert o == reference("mistral", tuple(p), N_OUT)


def test_long_prompt_in_less_kv_memory_than_all_global():
    prompt = prompts_of(6, (150,))[0]
    # 20 all-layer blocks of 4 tokens: 80 tokens all-global; the local pool holds a 16-token chunk's window
    eng = engine(MISTRAL, num_blocks=20, policy="hybrid", budget=16)
    assert eng.config.scheduler.max_model_len == 256  # not lowered: the window bounds what a sequence holds
    wp = eng.block_manager.window_pool
    out = generate(eng, [prompt], 30, bounded)[0]
    assert out == reference("mistral", tuple(prompt), 30)
    assert wp.peak_used <= wp.num_blocks - 1 < -(-(150 + 30) // BS)


def test_pp2_local_pools_per_stage_match_transformers(tmp_path):
    """pp = 2: each stage holds its layers' caches (stage 0: sliding-window layers in their pool, stage 1:
    the global layer), the local tables reach the stages as deltas (pipeline/wire/block_sync.py). Two
    samples of each prompt: their copy-on-write copies in the local pool reach stage 1 too, which has no
    local pool and must leave them alone (it indexed them into its global cache and crashed)."""
    from transformers import AutoModelForCausalLM

    from tdpipe import LLM
    from tdpipe.model.random_model import random_model_folder

    path = random_model_folder({**GEMMA3, "vocab_size": 300}, seed=4, root=tmp_path)  # a byte-level tokenizer
    prompts = prompts_of(7, (45, 26))
    with LLM(model=path, dtype="float32", num_kv_blocks=40, block_size=BS, max_model_len=256, scheduler="hybrid",
             max_num_batched_tokens=16, max_num_seqs=4, pipeline_parallel_size=2) as llm:
        wp = llm.engine.block_manager.window_pool
        assert wp is not None and wp.num_blocks < llm.engine.block_manager.num_blocks
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(n=2, temperature=0.0, max_tokens=N_OUT, ignore_eos=True), use_tqdm=False)
        llm.engine.block_manager.check_no_leaks()
        assert llm.engine.config.parallel.pipeline_parallel_size == 2
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    for p, o in zip(prompts, outs):
        ref = hf_greedy(model, p, N_OUT)
        assert [c.token_ids for c in o.outputs] == [ref, ref]


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    """A 45-token prefix (2.25 windows) shared by three prompts with suffixes of 3, 9 and 14 tokens."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(1, 97, (45,), generator=g).tolist()
    return [prefix + torch.randint(1, 97, (n,), generator=g).tolist() for n in (3, 9, 14)]


def greedy_logprobs(eng: LLMEngine, prompts: list[list[int]], n: int) -> list[list[tuple[int, float]]]:
    """(token, its logprob) of each greedy step of each prompt, the prompts run together."""
    p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1)
    for i, ids in enumerate(prompts):
        eng.add_request(str(i), ids, p)
    out: dict[str, list[tuple[int, float]]] = {str(i): [] for i in range(len(prompts))}
    while eng.has_unfinished():
        for d in eng.step():
            out[d.request_id] += [(lp[0][0], lp[0][1]) for lp in d.logprobs]
        bounded(eng)
    eng.block_manager.check_no_leaks()
    return [out[str(i)] for i in range(len(prompts))]


def counting_prefill(eng: LLMEngine) -> list[int]:
    """Wraps the scheduler so the returned list's one entry counts the prompt tokens prefilled."""
    seen = [0]
    schedule = eng.scheduler.schedule

    def wrapped():
        b = schedule()
        if b is not None:
            seen[0] += sum(n for s, n in zip(b.seqs, b.num_new_tokens) if s.num_computed_tokens < s.num_prompt_tokens)
        return b
    eng.scheduler.schedule = wrapped
    return seen


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
@pytest.mark.parametrize("policy", ["separate", "hybrid"])
def test_prefix_caching_with_a_window_hits_and_keeps_greedy_tokens(name, policy):
    """The first prompt runs alone; the next two hit its prefix (longer than the window): fewer tokens are
    prefilled, the greedy tokens equal transformers' and those of an engine with caching off, and so do
    their logprobs (to float32 rounding: a wrong or missing key in the window moves them far more, even
    where these random models' greedy choice does not change)."""
    hf = {"mistral": MISTRAL, "gemma3": GEMMA3}[name]
    prompts = shared_prefix_prompts(8)
    budget = 16 if policy == "hybrid" else None
    outs, prefilled = {}, {}
    for caching in (False, True):
        eng = engine(hf, num_blocks=200, policy=policy, budget=budget, caching=caching)
        seen = counting_prefill(eng)
        outs[caching] = greedy_logprobs(eng, prompts[:1], 12) + greedy_logprobs(eng, prompts[1:], 12)
        prefilled[caching] = seen[0]
        if caching:
            assert eng.block_manager.prefix_cache_hits >= 2 * 40  # each later prompt reuses >= 40 of 45
    assert prefilled[True] <= prefilled[False] - 2 * 40
    for p, on, off in zip(prompts, outs[True], outs[False]):
        assert [t for t, _ in on] == [t for t, _ in off] == reference(name, tuple(p), 12)
        assert max(abs(a - b) for (_, a), (_, b) in zip(on, off)) < 2e-5


def test_prefix_caching_with_a_window_under_preemption():
    """A local pool too small for three sequences: preempted ones recompute, hitting cached blocks where the
    window's blocks survived; greedy tokens equal transformers', logprobs those of caching off."""
    prompts = shared_prefix_prompts(9)
    runs = {}
    for caching in (False, True):
        eng = engine(MISTRAL, num_blocks=18, policy="hybrid", budget=16, caching=caching)
        runs[caching] = greedy_logprobs(eng, prompts, N_OUT)
        assert eng.scheduler.num_preemptions >= 1
        assert (eng.block_manager.prefix_cache_hits > 0) == caching
    for p, on, off in zip(prompts, runs[True], runs[False]):
        assert [t for t, _ in on] == [t for t, _ in off] == reference("mistral", tuple(p), N_OUT)
        assert max(abs(a - b) for (_, a), (_, b) in zip(on, off)) < 2e-5
