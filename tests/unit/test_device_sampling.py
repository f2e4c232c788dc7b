"""Sampling on the last stage (sampling/device_sampler.py, sampling/stage_rows.py, --sampling-device): greedy
rows unchanged, temperature rows drawn from softmax(logits / T) by Gumbel-max (T -> 0 is the argmax, only
tokens with real probability come out, a fixed seed repeats, vocabulary parts compose), the engine/stage
split of a batch, and through the engine: greedy and seeded requests give the same tokens whoever samples."""
import pytest
import torch

from tdpipe.config import CacheConfig, EngineConfig, SchedulerConfig
from tdpipe.core.engine import LLMEngine
from tdpipe.core.sample_group import SampleGroup
from tdpipe.sampling.device_sampler import DeviceSampler
from tdpipe.sampling.params import SamplingParams
from tdpipe.sampling.stage_rows import (samples_on_stage, split_rows, stage_rows, stage_seed, stage_temperature,
                                        stage_tokens)
from tdpipe.sequence import Sequence

V = 50


def test_greedy_rows_are_left_untouched():
    x = torch.randn(3, V)
    s = DeviceSampler()
    assert s.perturb(x, [0.0, 0.0, 0.0], seed=1) is x and s.perturb(x, [], seed=1) is x
    y = s.perturb(x, [0.0, 0.7, 0.0], seed=1)
    assert torch.equal(y[[0, 2]], x[[0, 2]]) and not torch.equal(y[1], x[1])
    assert torch.equal(x, x.clone())  # the caller's logits are not modified


def test_temperature_towards_zero_is_the_argmax():
    g = torch.Generator().manual_seed(0)
    x = torch.randperm(V, generator=g).float().repeat(64, 1) * 0.05  # distinct values, gaps of 0.05
    ids = DeviceSampler().sample(x, [1e-4] * 64, seed=3)
    assert torch.equal(ids, x.argmax(-1))


def test_only_likely_tokens_come_out_in_their_proportions_and_a_seed_repeats():
    x = torch.full((4000, V), -60.0)
    x[:, 3], x[:, 10], x[:, 41] = 2.0, 1.0, 0.0  # probabilities 0.665, 0.245, 0.090; the rest ~e^-62
    s = DeviceSampler()
    ids = s.sample(x, [1.0] * 4000, seed=7)
    assert set(ids.tolist()) == {3, 10, 41}
    freq = torch.bincount(ids, minlength=V)[[3, 10, 41]].float() / 4000
    torch.testing.assert_close(freq, torch.softmax(torch.tensor([2.0, 1.0, 0.0]), 0), atol=0.03, rtol=0)
    assert torch.equal(s.sample(x, [1.0] * 4000, seed=7), ids)  # deterministic for a seed
    assert not torch.equal(s.sample(x, [1.0] * 4000, seed=8), ids)
    hot = s.sample(x, [4.0] * 4000, seed=7)  # a higher temperature flattens: the top token loses share
    assert (hot == 3).float().mean() < freq[0] - 0.1


def test_vocabulary_parts_with_their_own_noise_compose_to_one_draw():
    """Two parts (tensor-parallel shards, a split lm_head) each perturb their columns with their own salt;
    the larger of the two maxima is a draw from the whole row."""
    x = torch.full((4000, V), -60.0)
    x[:, 3], x[:, 30] = 1.0, 0.0  # one likely token in each half
    s = DeviceSampler()
    a = s.perturb(x[:, :25], [1.0] * 4000, seed=5, salt=0)
    b = s.perturb(x[:, 25:], [1.0] * 4000, seed=5, salt=1)
    ids = torch.where(a.max(-1).values >= b.max(-1).values, a.argmax(-1), b.argmax(-1) + 25)
    assert set(ids.tolist()) == {3, 30}
    p3 = (ids == 3).float().mean().item()
    assert abs(p3 - torch.sigmoid(torch.tensor(1.0)).item()) < 0.03


# ------------------------------------------------------------------------------------- which rows
def seq(**kw) -> Sequence:
    s = Sequence(1, "r", [1, 2, 3], SamplingParams(**kw))
    SampleGroup(s)
    return s


@pytest.mark.parametrize("kw,want", [
    ({"temperature": 0.0}, 0.0), ({"temperature": 0.8}, 0.8), ({"temperature": 1.0, "top_k": 1}, 0.0),
    ({"temperature": 0.8, "seed": 3}, None), ({"temperature": 0.8, "top_p": 0.9}, None),
    ({"temperature": 0.8, "top_k": 5}, None), ({"temperature": 0.8, "min_p": 0.1}, None),
    ({"temperature": 0.8, "logprobs": 2}, None), ({"temperature": 0.8, "presence_penalty": 0.5}, None),
    ({"temperature": 0.8, "min_tokens": 2}, None), ({"temperature": 0.8, "n": 2}, None),
    ({"temperature": 0.8, "prompt_logprobs": 1}, None)])
def test_plain_rows_are_the_stages_and_the_rest_the_engines(kw, want):
    assert stage_temperature(seq(**kw)) == want


def test_an_n_request_after_its_forks_is_plain_again():
    s = seq(temperature=0.8, n=2)
    s.group.unforked = []  # forked at its first token: one draw per row since
    assert stage_temperature(s) == 0.8


def test_modes_and_the_fields_of_a_step():
    assert not samples_on_stage("auto", "cpu") and samples_on_stage("auto", "cuda")
    assert samples_on_stage("stage", "cpu") and not samples_on_stage("engine", "cuda")
    with pytest.raises(ValueError, match="sampling_device"):
        samples_on_stage("gpu", "cuda")
    seqs = [seq(temperature=0.0), seq(temperature=0.7), seq(temperature=0.7, seed=1)]
    assert stage_rows(seqs, on_stage=False) == ([True, False, False], [])  # what the engine always sent
    greedy, temps = stage_rows(seqs, on_stage=True)
    assert (greedy, temps) == ([True, True, False], [0.0, 0.7, 0.0])
    assert stage_seed([0.0, 0.0]) == 0 and stage_seed([]) == 0
    torch.manual_seed(4)
    a = stage_seed(temps)
    torch.manual_seed(4)
    assert stage_seed(temps) == a != 0  # from the engine's generator: --seed repeats it
    assert split_rows(greedy, temps, []) and not split_rows(greedy, [], [])
    assert not split_rows([True, True], [0.0, 0.5], []) and not split_rows(greedy, temps, [False, True, False])


def test_the_engine_samples_the_rows_the_stage_left():
    logits = torch.arange(2 * V, dtype=torch.float32).view(2, V)  # the logits of rows 1 and 3, in order
    seen = {}

    def sample(samples, rows):
        seen["samples"], seen["rows"] = samples, rows.clone()
        return [100 + i for i in range(len(samples))], [f"lp{i}" for i in range(len(samples))]

    ids = [5, -1, 7, -1]
    idx = [0, 1, 1, 2, 3]  # row 1 twice (a fork drawn from the same logits)
    toks, lps = stage_tokens(ids, logits, idx, ["a", "b", "c", "d", "e"], sample)
    assert toks == [5, 100, 101, 7, 102] and lps == [None, "lp0", "lp1", None, "lp2"]
    assert seen["samples"] == ["b", "c", "e"] and torch.equal(seen["rows"], logits[[0, 0, 1]])
    assert stage_tokens([4, 9], None, [1, 0], ["a", "b"], sample) == ([9, 4], [None, None])


# ------------------------------------------------------------------------------------------ the engine
TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 61, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "eos_token_id": 0}


def run(mode: str, params: list[SamplingParams]) -> tuple[list[list[int]], list[tuple[list, list]]]:
    """Each request's tokens, and each step's (greedy_rows, temperatures) as submitted (torch's thread
    count is left as it is)."""
    cfg = EngineConfig(dtype="float32", num_threads=torch.get_num_threads(), sampling_device=mode, seed=2,
                       cache=CacheConfig(block_size=4, num_blocks=64, enable_prefix_caching=False),
                       scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=128))
    engine = LLMEngine.from_config(cfg, hf_config=TINY, seed=1)
    seen = []
    submit = engine.executor.submit
    engine.executor.submit = lambda step: (seen.append((list(step.greedy_rows), list(step.temperatures))),
                                           submit(step))[1]
    out = {str(i): [] for i in range(len(params))}
    for i, p in enumerate(params):
        engine.add_request(str(i), [3 + i, 9, 14, 5 * i + 1], p)
    while engine.has_unfinished():
        for d in engine.step():
            out[d.request_id] += d.new_token_ids
    engine.block_manager.check_no_leaks()
    engine.shutdown()
    return [out[str(i)] for i in range(len(params))], seen


def test_stage_sampling_in_the_engine_keeps_greedy_and_seeded_requests_and_splits_the_rest():
    params = [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0.9, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=11, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.8, max_tokens=5, ignore_eos=True)]
    engine_out, engine_steps = run("engine", params)
    stage_out, stage_steps = run("stage", params)
    assert all(t == [] for _, t in engine_steps)  # engine mode: no temperatures sent, as before
    assert any(g == [True, True, False, False] and t[:2] == [0.0, 0.9] for g, t in stage_steps)
    assert stage_out[0] == engine_out[0]  # greedy: the same argmax
    assert stage_out[2] == engine_out[2]  # seeded: the engine's keyed stream either way
    assert all(len(o) == 5 and all(0 <= t < TINY["vocab_size"] for t in o) for o in stage_out)


def test_a_last_stage_sends_sampled_ids_and_split_head_parts_send_pairs_that_compose():
    """StageWorker's result paths without processes: ids for a batch the stage picks; each part of a split
    lm_head perturbs its own columns (salt: its rank) and the engine's pick of the best (max, id) pair is a
    draw from the whole row; with no temperatures the pairs are the plain argmax ones."""
    from types import SimpleNamespace

    from tdpipe.pipeline.stage_worker import StageWorker
    from tdpipe.pipeline.wire.messages import StepMessage

    sampler = DeviceSampler()

    def worker(rank: int, head_range: tuple[int, int]) -> StageWorker:
        w = object.__new__(StageWorker)
        w.rank, w.init = rank, SimpleNamespace(tp_rank=0)
        w.runner = SimpleNamespace(sampler=sampler, model=SimpleNamespace(head_range=head_range),
                                   sample=lambda x, t, seed, salt: sampler.sample(x, t, seed, salt))
        return w

    rows = 3000
    x = torch.full((rows, V), -60.0)
    x[:, 3], x[:, 30] = 1.0, 0.0
    msg = StepMessage(1, [], [1] * rows, [5] * rows, [], [], [], False, True, temperatures=[1.0] * rows,
                      stage_seed=9)
    ids = worker(1, (0, V))._result(x, msg)
    assert ids.dtype == torch.int64 and set(ids.tolist()) == {3, 30}
    parts = [worker(0, (0, 25))._split_result(x[:, :25], msg), worker(1, (25, V))._split_result(x[:, 25:], msg)]
    pairs = torch.stack(parts, dim=1)  # as PipelineExecutor.collect picks: the larger maximum
    best = pairs[:, :, 0].argmax(dim=1)
    picked = pairs[torch.arange(rows), best, 1].to(torch.int64)
    assert set(picked.tolist()) == {3, 30}
    assert abs((picked == 3).float().mean().item() - torch.sigmoid(torch.tensor(1.0)).item()) < 0.03
    msg.temperatures = None
    assert worker(0, (0, 25))._split_result(x[:, :25], msg)[:, 1].eq(3).all()
