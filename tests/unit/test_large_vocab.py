"""Sampling on large vocabularies (Gemma 3: 262,144 columns): the sampler reads the caller's logits in place,
copies only the rows it must, widens its top-k / top-p candidates before a full sort, and draws exactly the
random numbers it always drew (one per column of the race: the candidates, or the whole vocabulary in
vocabulary order)."""
from __future__ import annotations

import pytest
import torch

from tdpipe.model.tensor_parallel import TPGroup, greedy_ids
from tdpipe.sampling import sampler as S
from tdpipe.sampling.device_sampler import DeviceSampler
from tdpipe.sampling.metadata import SamplingMetadata
from tdpipe.sampling.params import SamplingParams
from tdpipe.sampling.seeds import draw_key

V = 262144


def _logits(b: int, seed: int, flat: tuple[int, ...] = ()) -> torch.Tensor:
    """Peaked rows (a nucleus of a few tokens), and `flat` rows whose top-p 0.9 nucleus holds thousands."""
    x = torch.randn(b, V, generator=torch.Generator().manual_seed(seed)) * 5.0
    for r in flat:
        x[r] *= 0.5
    return x


def _meta(params: list[SamplingParams], logprobs: list[int | None] | None = None) -> SamplingMetadata:
    keys = [draw_key(p.seed, 3) if p.seed is not None else None for p in params]
    return SamplingMetadata(params, [[]] * len(params), [[]] * len(params), keys, None, logprobs)


def test_wide_candidates_draw_what_the_full_sort_draws(monkeypatch):
    """Flat top-p rows (nucleus ~10k tokens) leave the 256 candidates: the wider tries pick the same tokens
    as the full sort did, with the same draws (vocabulary order, one per column)."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s) for s in range(6)]
    params.append(SamplingParams(temperature=1.0, top_k=5000, seed=9))  # a top-k wider than 4096
    logits = _logits(len(params), 1, flat=tuple(range(len(params))))
    calls: list[int] = []
    real = S.candidate_masks
    monkeypatch.setattr(S, "candidate_masks",
                        lambda *a, **k: calls.append(k.get("k", S.CANDIDATES)) or real(*a, **k))
    got = S.Sampler()(logits, _meta(params))
    assert calls == [S.CANDIDATES, *S.WIDE_CANDIDATES]  # 4096 covers some, 32768 the rest
    monkeypatch.setattr(S, "WIDE_CANDIDATES", ())  # the full sort for every uncovered row
    assert S.Sampler()(logits, _meta(params)) == got
    assert len(set(got)) > 1


def test_mixed_batch_bf16_logits_and_caller_tensor():
    """Greedy, top-p, top-k, plain temperature, penalties, a ban and logprobs in one batch: bf16 logits give
    what their float32 copy gives (the sampler widens per row), and the caller's tensor is left as it was."""
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.9, seed=1),
              SamplingParams(temperature=1.0, top_k=50, seed=2), SamplingParams(temperature=0.7, seed=3),
              SamplingParams(temperature=0, repetition_penalty=1.3),
              SamplingParams(temperature=1.0, min_p=0.1, seed=4),
              SamplingParams(temperature=0.9, top_p=0.95, seed=5, presence_penalty=0.5)]
    logits = _logits(len(params), 2, flat=(1, 3)).to(torch.bfloat16)
    before = logits.clone()
    meta = _meta(params, [5, 2, None, 0, 3, None, 1])
    meta.prompt_ids = [[], [], [], [], [1, 2, 3], [], [4]]
    meta.output_ids = [[], [], [], [], [7], [], [8, 8]]
    meta.banned = [[int(logits[0].float().argmax())], [], [], [], [], [], []]
    toks, lps = S.Sampler().sample(logits, meta)
    toks32, lps32 = S.Sampler().sample(logits.float(), meta)
    assert toks == toks32 and lps == lps32
    assert torch.equal(logits, before)
    assert toks[0] != meta.banned[0][0] and toks[0] == int(logits[0].float().topk(2).indices[1])
    assert [len(e) for e in lps if e is not None] == [6, 3, 1, 4, 2] and lps[2] is None


def test_logsumexp_from_the_known_maximum_is_torchs():
    """csrc/lse.cpp's one pass (its own exp) is torch's logsumexp to float rounding; the torch fallback (a
    non-contiguous view here) gives torch's bits."""
    x = _logits(3, 3, flat=(1,))
    x[2, 7:] = float("-inf")
    top = x.topk(1, dim=-1).values
    torch.testing.assert_close(S._logsumexp(x, top), x.logsumexp(-1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(S._logsumexp(x, top[[2, 0]], torch.tensor([2, 0])), x[[2, 0]].logsumexp(-1),
                               rtol=1e-6, atol=1e-6)
    view = torch.cat([x, torch.zeros(3, 5)], dim=1)[:, :x.shape[1]]
    assert torch.equal(S._logsumexp(view, top), x.logsumexp(-1))
    assert torch.equal(S._logsumexp(view, top[[2, 0]], torch.tensor([2, 0])), x[[2, 0]].logsumexp(-1))
    # a row whose largest value is +inf (top taken as 0): +inf, as torch's
    y = x.clone()
    y[1, 4] = float("inf")
    assert S._logsumexp(y, y.topk(1, dim=-1).values)[1] == float("inf")


def test_tensor_parallel_greedy_ids_on_a_large_vocabulary():
    """Two vocabulary shards agree on the full argmax with a [S, 2] gather; a tie across the boundary goes
    to the lower id, as torch.argmax over the whole row does."""
    x = _logits(4, 4)
    x[3, 10] = x[3, V // 2 + 5] = 1e4  # equal maxima on both shards

    class Pair(TPGroup):
        size = 2

        def __init__(self, rank: int, other: torch.Tensor | None) -> None:
            super().__init__()
            self.rank, self.other, self.sent = rank, other, None

        def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
            self.sent = t
            other = t if self.other is None else self.other  # None: only record what this rank sends
            return torch.cat([other, t] if self.rank else [t, other], dim)

    half = V // 2
    shards = [x[:, :half].contiguous(), x[:, half:].contiguous()]
    sent = []
    for rank in range(2):
        g = Pair(rank, None)
        greedy_ids(shards[rank], rank * half, g)
        sent.append(g.sent)
    for rank in range(2):
        ids = greedy_ids(shards[rank], rank * half, Pair(rank, sent[1 - rank]))
        assert ids.tolist() == x.argmax(-1).tolist() and ids[3] == 10


def test_device_sampler_perturbs_in_place_with_the_same_values():
    """On CPU the stage's noise is the race's hashed noise, keyed per row by (seed, salt, row): the kernel's
    values are race.race_scores' (the torch reference), bit for bit."""
    from tdpipe.sampling import race
    from tdpipe.sampling.seeds import draw_key, draw_keys

    x = _logits(4, 5)[:, :4096]
    temps = [0.0, 0.7, 1.3, 0.0]
    got = DeviceSampler().perturb(x, temps, 11, 2)
    keys = torch.tensor([race.signed64(k) for k in draw_keys([draw_key(11, 2)] * 2, [1, 2])])
    want = x.clone()
    want[[1, 2]] = race.race_scores(x[[1, 2]] / torch.tensor([0.7, 1.3])[:, None], keys)
    assert torch.equal(got, want)
    assert torch.equal(race.perturb_(x[[1, 2]].clone(), torch.tensor([0.7, 1.3]), keys), want[[1, 2]])
    # the reference path (no kernel) of perturb_, in row chunks
    old = race.REFERENCE_ELEMENTS
    try:
        race.REFERENCE_ELEMENTS = 4096
        ref = race.perturb_(x[[1, 2]].clone().t().contiguous().t(), torch.tensor([0.7, 1.3]), keys)
    finally:
        race.REFERENCE_ELEMENTS = old
    assert torch.equal(ref, want[[1, 2]])


def test_sampler_bench_runs():
    from tdpipe.bench.sampler import report, run

    r = run(batch=12, vocab=5000, hidden=16, iters=1)
    assert r["sample_best_s"] > 0 and len(r["digest"]) == 12 and "rows x 5000 columns" in report(r)


@pytest.mark.parametrize("seed", range(2))
def test_unseeded_rows_draw_the_global_stream_as_before(seed):
    """Unseeded rows still draw from torch's global generator in one call per path: the same global seed
    gives the same tokens however the batch's rows are laid out in memory (a non-contiguous view)."""
    params = [SamplingParams(temperature=0.9, top_p=0.9), SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, top_k=20)] * 2
    x = _logits(len(params), 6 + seed, flat=(0,))
    wide = torch.cat([x, torch.zeros(len(params), 8)], dim=1)[:, :V]
    torch.manual_seed(seed)
    a = S.Sampler()(x, _meta(params))
    torch.manual_seed(seed)
    assert S.Sampler()(wide, _meta(params)) == a
