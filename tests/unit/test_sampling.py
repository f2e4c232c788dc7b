"""Sampling layer: parameter validation, masks, penalties and seeded reproducibility. No model needed."""

import pytest
import torch

from tdpipe.sampling import SamplingParams
from tdpipe.sampling.metadata import SamplingMetadata
from tdpipe.sampling.sampler import Sampler, apply_min_p, apply_penalties, apply_top_k_top_p, make_generator

V = 32


# ---------------------------------------------------------------- validation

@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"n": 0}, "n"),
        ({"n": 2.0}, "n"),
        ({"n": 4, "best_of": 2}, "best_of"),
        ({"best_of": 0}, "best_of"),
        ({"stop": 5}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"seed": "x"}, "seed"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"logit_bias": [5]}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
        ({"allowed_token_ids": 5}, "allowed_token_ids"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**kwargs)


def test_message_gives_range():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match=r"best_of must be None or an int >= n \(3\), got 2"):
        SamplingParams(n=3, best_of=2)
    assert SamplingParams(n=2, best_of=4).num_samples == 4 and SamplingParams(n=3).num_samples == 3
    assert SamplingParams(n=2, best_of=4).needs_logprobs and not SamplingParams(n=2).needs_logprobs


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1, 1.0, 1.0, -1, 0.0, 16)
    assert p.stop == [] and p.stop_token_ids == [] and not p.is_greedy and not p.needs_penalties
    assert p.max_stop_str_len == 0
    p = SamplingParams(stop="END", stop_token_ids=(7, 8), top_k=0, max_tokens=None)
    assert p.stop == ["END"] and p.stop_token_ids == [7, 8] and p.top_k == -1 and p.max_tokens is None
    assert SamplingParams(stop=["a", "abcd"]).max_stop_str_len == 4
    assert SamplingParams(temperature=0).is_greedy and SamplingParams(top_k=1).is_greedy
    assert SamplingParams(repetition_penalty=1.1).needs_penalties
    assert SamplingParams(presence_penalty=0.5).needs_penalties
    assert SamplingParams(frequency_penalty=-0.5).needs_penalties


def test_clone_and_finished_as_vllm_names_them():
    from tdpipe import CompletionOutput

    p = SamplingParams(stop=["a"], logit_bias={3: 1.0}, bad_words=["x"])
    q = p.clone()
    q.stop.append("b")
    q.logit_bias[4] = 2.0
    assert q == SamplingParams(stop=["a", "b"], logit_bias={3: 1.0, 4: 2.0}, bad_words=["x"])
    assert p.stop == ["a"] and p.logit_bias == {3: 1.0}  # the original untouched
    assert not CompletionOutput(0, "", [], None).finished() and CompletionOutput(0, "", [], "stop").finished()


# ---------------------------------------------------------------- sampler paths

def _call(logits, params, generators=None, prompts=None, outputs=None):
    b = len(params)
    return Sampler()(logits, SamplingMetadata(params, prompts or [[]] * b, outputs or [[]] * b, generators or [None] * b))


def test_greedy_fast_path_is_argmax():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    before = logits.clone()
    assert _call(logits, [SamplingParams(temperature=0)] * 5) == logits.argmax(-1).tolist()
    assert torch.equal(logits, before)


def test_top_k_1_with_temperature_is_argmax():
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.5, top_k=1)] * 6
    assert _call(logits, params) == logits.argmax(-1).tolist()
    # Through the mask path too: top_k=1 leaves a single finite logit, the argmax.
    masked = apply_top_k_top_p(logits, torch.ones(6, dtype=torch.long), None)
    assert torch.equal(masked.argmax(-1), logits.argmax(-1))
    assert (masked.isfinite().sum(-1) == 1).all()


def _seeded_run(seed: int, row: int, others: list[SamplingParams]) -> list[int]:
    """20 decode steps of a seeded request placed at `row` among unseeded random rows."""
    mine = torch.randn(20, V, generator=torch.Generator().manual_seed(123))
    steps = torch.randn(20, len(others) + 1, V, generator=torch.Generator().manual_seed(len(others)))
    params = list(others)
    params.insert(row, SamplingParams(temperature=1.0, top_p=0.95, seed=seed))
    gens = [None] * len(params)
    gens[row] = make_generator(params[row])
    torch.manual_seed(999 + len(others))  # the unseeded rows' draws differ per layout
    out = []
    for step, row_logits in zip(steps, mine):
        step[row] = row_logits  # the seeded row sees the same logits in every layout
        out.append(_call(step, params, gens)[row])
    return out


def test_seeded_rows_reproduce_alone_and_in_a_batch():
    alone = _seeded_run(7, 0, [])
    assert _seeded_run(7, 0, []) == alone
    others = [SamplingParams(temperature=0.8), SamplingParams(top_k=5, min_p=0.1), SamplingParams(temperature=0)]
    assert _seeded_run(7, 2, others) == alone
    assert _seeded_run(7, 0, others[:1]) == alone
    assert _seeded_run(8, 0, []) != alone


def test_temperature_sampling_matches_softmax():
    torch.manual_seed(0)
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5])
    n = 20000
    tokens = _call(logits.expand(n, 4), [SamplingParams(temperature=0.7)] * n)
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / n
    assert torch.allclose(freq, (logits / 0.7).softmax(-1), atol=0.02)


def test_masks_restrict_sampled_tokens():
    torch.manual_seed(0)
    logits = torch.tensor([3.0, 2.9, 2.8, 2.7, 0.0, -1.0])
    n = 2000
    tokens = set(_call(logits.expand(n, 6), [SamplingParams(top_k=3)] * n))
    assert tokens == {0, 1, 2}


# ---------------------------------------------------------------- masks

def test_top_k_keeps_exactly_k():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    out = apply_top_k_top_p(logits, torch.tensor([2, -1, 5]), None)
    assert out.isfinite().sum(-1).tolist() == [2, V, 5]
    for row, k in [(0, 2), (2, 5)]:
        kept = set(out[row].isfinite().nonzero().flatten().tolist())
        assert kept == set(logits[row].topk(k).indices.tolist())
        assert torch.equal(out[row][out[row].isfinite()], logits[row][out[row].isfinite()])


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])  # sorted: 0.5 (1), 0.3 (3), 0.15 (0), 0.05 (2)
    logits = probs.log().expand(4, 4)
    out = apply_top_k_top_p(logits, None, torch.tensor([0.4, 0.75, 0.9, 1.0]))
    kept = [set(r.isfinite().nonzero().flatten().tolist()) for r in out]
    assert kept == [{1}, {1, 3}, {1, 3, 0}, {0, 1, 2, 3}]


def test_top_k_then_top_p():
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    # top-k=2 leaves {0.5, 0.3} renormalised to {0.625, 0.375}; p=0.6 then keeps only the first.
    out = apply_top_k_top_p(probs.log().unsqueeze(0), torch.tensor([2]), torch.tensor([0.6]))
    assert out[0].isfinite().nonzero().flatten().tolist() == [1]


def test_min_p_mask():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    out = apply_min_p(probs.log().expand(3, 4), torch.tensor([0.25, 0.7, 0.0]))
    assert out.isfinite().tolist() == [
        [True, True, True, False],  # threshold 0.125
        [True, False, False, False],  # threshold 0.35
        [True, True, True, True],
    ]


# ---------------------------------------------------------------- penalties

LOGITS = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
PROMPT, OUTPUT = [[0]], [[1, 1, 2]]  # output counts: [0, 2, 1, 0]


def _pen(rep=1.0, freq=0.0, pres=0.0):
    rep, freq, pres = (torch.tensor([x]) for x in (rep, freq, pres))
    return apply_penalties(LOGITS, PROMPT, OUTPUT, rep, freq, pres)[0].tolist()


def test_repetition_penalty_over_prompt_and_output():
    assert _pen(rep=2.0) == [1.0, -2.0, 0.25, 3.0]


def test_frequency_penalty_over_output_counts():
    assert _pen(freq=0.5) == [2.0, -2.0, 0.0, 3.0]


def test_presence_penalty_over_output_once():
    assert _pen(pres=0.5) == [2.0, -1.5, 0.0, 3.0]


def test_penalties_combined_and_in_sampler():
    assert _pen(rep=2.0, freq=0.5, pres=0.5) == [1.0, -3.5, -0.75, 3.0]
    # Greedy with a repetition penalty: token 3 (seen) drops below token 0 (unseen).
    logits = torch.tensor([[2.0, 0.0, 0.0, 3.0], [2.0, 0.0, 0.0, 3.0]])
    params = [SamplingParams(temperature=0, repetition_penalty=2.0), SamplingParams(temperature=0)]
    assert _call(logits, params, prompts=[[3], [3]], outputs=[[], []]) == [0, 3]
    assert logits[0, 3] == 3.0  # caller's tensor untouched


def test_logit_bias_moves_the_argmax_the_draw_and_the_logprobs():
    """OpenAI's logit_bias added to the row's logits before anything else: +100 forces a token, -100 bans the
    argmax; a biased row leaves the greedy hot path (its neighbours keep theirs) and the caller's tensor is
    untouched; logprobs are of the biased distribution."""
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3))
    before, top = logits.clone(), logits.argmax(-1).tolist()
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, logit_bias={7: 100.0}),
              SamplingParams(temperature=0, logit_bias={top[2]: -100.0}, logprobs=1),
              SamplingParams(temperature=1.0, seed=4, logit_bias={9: 100.0})]
    meta = SamplingMetadata(params, [[]] * 4, [[]] * 4, [None, None, None, 5], num_logprobs=[None, None, 1, None])
    tokens, lps = Sampler().sample(logits, meta)
    second = logits[2].clone()
    second[top[2]] -= 100.0
    assert tokens == [top[0], 7, int(second.argmax()), 9]
    assert torch.equal(logits, before)
    expect = torch.log_softmax(second, -1)[tokens[2]].item()
    assert lps[2][0][1] == pytest.approx(expect, abs=1e-5)  # (token, logprob, rank) of the sampled token
    assert not params[1].needs_penalties and params[1].needs_processing


def test_allowed_token_ids_keep_only_those():
    """vLLM's allowed_token_ids: every other token out of the row (greedy, a draw, with a bias too); the
    logprobs are of the restricted distribution."""
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5))
    allowed = [3, 11, 17]
    params = [SamplingParams(temperature=0, allowed_token_ids=allowed, logprobs=2),
              SamplingParams(temperature=1.0, seed=2, allowed_token_ids=allowed),
              SamplingParams(temperature=0, allowed_token_ids=allowed, logit_bias={11: 100.0})]
    meta = SamplingMetadata(params, [[]] * 3, [[]] * 3, [None, 3, None], num_logprobs=[2, None, None])
    tokens, lps = Sampler().sample(logits, meta)
    assert tokens[0] == allowed[int(logits[0, allowed].argmax())] and tokens[1] in allowed and tokens[2] == 11
    restricted = torch.log_softmax(logits[0, allowed], -1)
    assert lps[0][0][1] == pytest.approx(restricted.max().item(), abs=1e-5)
    assert {t for t, _, _ in lps[0][1:]} <= set(allowed)  # the top-2 are allowed ones


@pytest.mark.parametrize("seed", range(6))
def test_candidate_masks_equal_the_full_sort(seed):
    """The fast path (top-k / top-p / min-p on each row's top candidates) keeps exactly the tokens the full
    sort keeps, on every row it reports as covered; rows it cannot cover are flagged, never guessed."""
    from tdpipe.sampling.sampler import apply_min_p, apply_top_k_top_p, candidate_masks

    g = torch.Generator().manual_seed(seed)
    b, vocab = 24, 3000
    logits = torch.randn(b, vocab, generator=g) * torch.linspace(0.2, 6.0, b).unsqueeze(1)  # flat .. peaked
    top_k = torch.tensor([[0, 1, 5, 40, 300, 2999][i % 6] for i in range(b)])
    top_p = torch.tensor([[1.0, 0.9, 0.5, 0.99][i % 4] for i in range(b)])
    min_p = torch.tensor([[0.0, 0.0, 0.05][i % 3] for i in range(b)])
    vals, ids, keep, covered = candidate_masks(logits, top_k, top_p, min_p, k=64)
    full = apply_min_p(apply_top_k_top_p(logits, top_k, top_p), min_p) > float("-inf")
    assert covered.any() and not covered.all()
    for r in range(b):
        fast = torch.zeros(vocab, dtype=torch.bool)
        fast[ids[r][keep[r]]] = True
        if covered[r]:
            assert torch.equal(fast, full[r]), f"row {r}"
        else:  # a survivor outside the candidates, a top-k wider than them, or no top-k/top-p at all
            cand = torch.zeros(vocab, dtype=torch.bool)
            cand[ids[r]] = True
            assert (full[r] & ~cand).any() or 64 < top_k[r] < vocab or (top_k[r] <= 0 and top_p[r] >= 1)


def test_fast_path_samples_the_same_distribution():
    """top-p sampling through the candidate path matches the renormalised nucleus probabilities."""
    from tdpipe.sampling.sampler import Sampler

    logits = torch.log(torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02]))
    logits = torch.cat([logits, torch.full((500,), -30.0)])
    p = SamplingParams(temperature=1.0, top_p=0.85, seed=None)
    n = 6000
    toks = Sampler()(logits.repeat(n, 1), SamplingMetadata([p] * n, [[]] * n, [[]] * n, [None] * n))
    counts = torch.bincount(torch.tensor(toks), minlength=logits.numel()).float() / n
    expect = torch.tensor([0.4, 0.25, 0.15, 0.1]) / 0.9  # smallest prefix reaching 0.85: 4 tokens
    assert counts[4:].sum() == 0
    assert torch.allclose(counts[:4], expect, atol=0.025)


def test_sampling_metadata_from_samples():
    """One row per (sequence, sample index): stop tokens banned before min_tokens, a seeded row keyed by (its
    sample's seed, the position), history only for penalised rows, logprob k only where asked."""
    from tdpipe.sampling.seeds import draw_key, sample_seed
    from tdpipe.sequence import Sequence

    a = Sequence(0, "a", [1, 2], SamplingParams(min_tokens=2, stop_token_ids=[9], seed=5, n=2, temperature=1.0))
    b = Sequence(1, "b", [3], SamplingParams(repetition_penalty=1.2, logprobs=2), output_token_ids=[4])
    meta = SamplingMetadata.from_samples([(a, 0), (a, 1), (b, 0)], eos_token_ids={0})
    assert meta.banned == [[0, 9], [0, 9], []]
    assert meta.keys == [draw_key(5, 0), draw_key(sample_seed(5, 1), 0), None]
    assert meta.prompt_ids == [[], [], [3]] and meta.output_ids == [[], [], [4]]
    assert meta.num_logprobs == [None, None, 2] and len(meta) == 3


def test_prompt_logprobs_in_row_chunks_equal_one_pass(monkeypatch):
    """token_logprobs works through [rows, vocab] a few rows at a time (a 262k vocabulary's float32 copies of
    a whole prefill chunk ran a 24 GiB machine out of memory): same answers as one pass."""
    import tdpipe.sampling.sampler as sampler_mod

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(13, 97, generator=g).bfloat16()
    toks = torch.randint(0, 97, (13,), generator=g).tolist()
    whole = sampler_mod.Sampler.token_logprobs(logits, toks, 3)
    monkeypatch.setattr(sampler_mod, "PROMPT_LOGPROBS_CHUNK", 97 * 4)  # 4 rows a chunk
    assert sampler_mod.Sampler.token_logprobs(logits, toks, 3) == whole
    monkeypatch.setattr(sampler_mod, "PROMPT_LOGPROBS_CHUNK", 1)  # one row a chunk
    assert sampler_mod.Sampler.token_logprobs(logits, toks, 3) == whole
