"""The exponential race with hashed noise on logits (sampling/race.py, csrc/race.cpp): the kernel and the torch
reference give the same tokens bit for bit, the tokens follow the probabilities and the temperature, and the
sampler's seeded rows depend on their key alone."""
from __future__ import annotations

import math

import pytest
import torch

from tdpipe.model import cpu_ops
from tdpipe.sampling import race as R
from tdpipe.sampling.metadata import SamplingMetadata
from tdpipe.sampling.params import SamplingParams
from tdpipe.sampling.sampler import Sampler
from tdpipe.sampling.seeds import draw_key


def _keys(n: int, seed: int) -> torch.Tensor:
    return torch.tensor([R.signed64(draw_key(seed, i)) for i in range(n)], dtype=torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 7), (5, 16), (4, 33), (64, 1000), (2, 40000)])
def test_kernel_gives_the_reference_bits(rows, cols, dtype):
    """Listed rows of a wider tensor, each with its own temperature, fp32 and bf16 logits, masked tokens."""
    k = cpu_ops.kernel()
    if k is None:
        pytest.skip("no C++ kernel on this machine")
    g = torch.Generator().manual_seed(rows * cols)
    x = (torch.randn(rows + 3, cols, generator=g) * 4).to(dtype)
    x[1, : cols // 2] = float("-inf")  # banned tokens
    idx = torch.randperm(rows + 3, generator=g)[:rows]
    temps = torch.rand(rows, generator=g) * 1.5 + 0.05
    keys = _keys(rows, cols)
    keys[-1] = -(1 << 63)  # the extreme keys too
    want = R.race_reference(x, keys, idx, temps)
    assert torch.equal(k.race_rows(x, idx, temps, keys), want)
    assert torch.equal(R.race(x, keys, idx, temps), want)
    assert (want >= 0).all() and (want < cols).all()
    # in place with temperatures = a float32 copy divided first, raced without them
    xs = x[idx].float() / temps[:, None]
    assert torch.equal(R.race(xs, keys), want) and torch.equal(R.race_reference(xs, keys), want)


def test_reference_chunks_agree_with_one_pass():
    """race_reference scores a wide row in column chunks: the winner is the one of one pass over the row."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5000, generator=g) * 3
    keys = _keys(3, 9)
    one = R.race_scores(x, keys).argmax(-1)
    old = R.REFERENCE_ELEMENTS
    try:
        R.REFERENCE_ELEMENTS = 512
        assert torch.equal(R.race_reference(x, keys), one)
    finally:
        R.REFERENCE_ELEMENTS = old


def test_masked_rows_and_nan_rows_pick_as_torch_argmax_would():
    """A row with nothing allowed (all -inf): index 0, every score -inf; a NaN logit wins, the first one, as
    torch's argmax picks; one allowed token is always the one drawn; in the kernel and the reference."""
    x = torch.full((3, 40), float("-inf"))
    x[1, 5:] = float("nan")
    x[2, 17] = 3.0
    keys = _keys(3, 1)
    for got in (R.race_reference(x, keys), R.race(x, keys)):
        assert got.tolist() == [0, 5, 17]


def test_tokens_follow_the_probabilities():
    """20,000 rows of one 10-token distribution (as logits: ln p), each row keyed differently: the counts pass
    a chi-square test at p = 1e-4 (df 9: 33.7); the keys are fixed, so the test is deterministic. A 1e-3
    token is drawn about 20 times, a 1e-9 token never."""
    probs = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.05, 0.05, 0.03, 0.019, 0.001])
    probs = torch.cat([probs * (1 - 1e-9), torch.tensor([1e-9])])
    n = 20000
    x = probs.log().expand(n, -1).contiguous()
    got = R.race(x, _keys(n, 12345))
    counts = torch.bincount(got, minlength=11).double()
    expected = probs.double() * n
    chi2 = float(((counts[:10] - expected[:10]) ** 2 / expected[:10]).sum())
    assert chi2 < 33.7, (chi2, counts.tolist())
    assert 5 <= counts[9] <= 40 and counts[10] == 0


def test_temperature_flattens_and_sharpens():
    """Two tokens with logits 0 and ln 3 (p = 1/4, 3/4): at t = 2 the second has p = sqrt 3 / (1 + sqrt 3) =
    0.634, at t = 0.5 p = 9 / 10; 20,000 draws each within 4 standard deviations."""
    n = 20000
    x = torch.tensor([[0.0, math.log(3.0)]]).expand(n, -1).contiguous()
    for t, p in ((2.0, 3 ** 0.5 / (1 + 3 ** 0.5)), (0.5, 0.9)):
        got = R.race(x, _keys(n, 31), torch.arange(n), torch.full((n,), t))
        share = float(got.double().mean())
        assert abs(share - p) < 4 * math.sqrt(p * (1 - p) / n), (t, share, p)


def test_columns_and_rows_draw_independently():
    """Uniform over 64 tokens, 64,000 draws: every column drawn about 1,000 times (chi-square df 63 at
    p = 1e-4: 112), and consecutive rows' tokens uncorrelated (the pair counts of (token_i, token_i+1) mod 4:
    chi-square df 15 at p = 1e-4: 42.3)."""
    n, v = 64000, 64
    got = R.race(torch.zeros(n, v), _keys(n, 777))
    counts = torch.bincount(got, minlength=v).double()
    assert float(((counts - n / v) ** 2 / (n / v)).sum()) < 112
    a, b = got[:-1] % 4, got[1:] % 4
    pairs = torch.bincount(a * 4 + b, minlength=16).double()
    e = (n - 1) / 16
    assert float(((pairs - e) ** 2 / e).sum()) < 42.3


def _meta(params: list[SamplingParams], keys: list) -> SamplingMetadata:
    return SamplingMetadata(params, [[] for _ in params], [[] for _ in params], keys, None, [None] * len(params))


def test_seeded_rows_draw_the_same_alone_and_in_any_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 3000, generator=g) * 2
    params = [SamplingParams(temperature=0.9, seed=i) for i in range(6)]
    keys = [draw_key(i, 4) for i in range(6)]
    s = Sampler()
    together = s.sample(logits, _meta(params, keys))[0]
    alone = [s.sample(logits[i:i + 1], _meta(params[i:i + 1], keys[i:i + 1]))[0][0] for i in range(6)]
    reversed_ = s.sample(logits.flip(0), _meta(params[::-1], keys[::-1]))[0][::-1]
    assert together == alone == reversed_


def test_unseeded_rows_repeat_under_torch_manual_seed_and_differ_without():
    logits = torch.zeros(64, 1000)  # uniform: any draw is plausible, so equal draws are not by chance
    params = [SamplingParams(temperature=1.0)] * 64
    s = Sampler()
    torch.manual_seed(5)
    a = s.sample(logits, _meta(params, [None] * 64))[0]
    torch.manual_seed(5)
    b = s.sample(logits, _meta(params, [None] * 64))[0]
    c = s.sample(logits, _meta(params, [None] * 64))[0]
    assert a == b and a != c
    assert len(set(a)) > 40  # 64 rows, 1,000 tokens: rows draw independently


def test_a_callers_generator_still_draws_from_its_own_stream():
    """A torch.Generator row (a caller driving one stream) keeps exponential_ from that stream: the same
    generator state gives the same token, whatever the other rows are."""
    logits = torch.zeros(3, 500)
    params = [SamplingParams(temperature=1.0)] * 3
    s = Sampler()
    tok = []
    for other in (11, 99):
        gen = torch.Generator().manual_seed(42)
        tok.append(s.sample(logits, _meta(params, [draw_key(other, 0), gen, None]))[0][1])
    assert tok[0] == tok[1]


def test_ln_is_ln_to_float32_precision():
    y = torch.tensor([1e-30, 1e-7, 0.01, 0.3, 0.5, 0.70710678, 0.9, 0.99999, 1.0, 1.5, 7.0, 88.0, 3e30])
    got = R._ln(y).double()
    want = torch.log(y.double())
    assert ((got - want).abs() <= 4e-7 * want.abs().clamp_min(1.0)).all(), (got - want).tolist()
    assert float(R._ln(torch.zeros(1))) < -87  # 0: a large finite negative, a loser's noise


def test_exponential_noise_has_mean_one_and_the_right_tail():
    """q = -ln(1 - v) over 2^20 columns of one key (the score of a zero logit is -ln q): mean 1 (sd of the
    mean ~0.001), P(q < 1e-3) ~ 1e-3 (the small-v series), P(q > 5) ~ e^-5."""
    n = 1 << 20
    q = torch.exp(-R.race_scores(torch.zeros(1, n), _keys(1, 3))[0].double())
    assert abs(float(q.mean()) - 1.0) < 0.005
    assert abs(float((q < 1e-3).double().mean()) - (1 - math.exp(-1e-3))) < 2e-4
    assert abs(float((q > 5).double().mean()) - math.exp(-5)) < 1e-3


def test_plain_rows_race_in_place_with_the_copied_rows_bits():
    """Plain temperature rows race where their logits lie (the caller's bf16 tensor, or the changed copy of the
    rows with bans or penalties), dividing by the temperature inside the kernel. A min_p of 1e-12 masks
    nothing here (logits within +-10) but sends a row through the copied, divided path: the same tokens."""
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(8, 3000, generator=g) * 2).bfloat16()
    keys = [draw_key(i, 3) for i in range(8)]

    def params(min_p: float) -> list[SamplingParams]:
        return [SamplingParams(temperature=0.5 + 0.1 * i, seed=i, min_p=min_p,
                               repetition_penalty=1.3 if i % 3 == 0 else 1.0) for i in range(8)]

    def meta(ps: list[SamplingParams]) -> SamplingMetadata:
        return SamplingMetadata(ps, [[1, 2, 3]] * 8, [[4, 5]] * 8, keys, [[7]] * 8,
                                [None] * 8)

    s = Sampler()
    in_place = s.sample(logits, meta(params(0.0)))[0]
    copied = s.sample(logits, meta(params(1e-12)))[0]
    assert in_place == copied
    assert all(t != 7 for t in in_place)  # the banned token


def test_perturbed_scores_argmax_is_the_race():
    """race_perturb_ writes the scores race_rows maximises: their argmax is its token, and a shard of columns
    hashed from col0 on holds the same scores as those columns of the whole row."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 700, generator=g) * 3
    keys, temps = _keys(5, 6), torch.rand(5, generator=g) + 0.2
    whole = R.perturb_(x.clone(), temps, keys)
    assert torch.equal(whole.argmax(-1), R.race(x, keys, torch.arange(5), temps))
    part = R.perturb_(x[:, 300:].contiguous(), temps, keys, col0=300)
    assert torch.equal(part, whole[:, 300:])


@pytest.mark.parametrize("k", [1, 50, 256, 300])
def test_top_candidates_are_a_stable_sorts(k):
    """csrc/topk.cpp against the fallback (a stable descending sort, forced by a non-contiguous view): the same
    values and ids, ties by the lower column, on rows with many ties (bf16-rounded), masked tails, a NaN
    (first, as torch's sort puts it), -0 beside +0, all equal, and rows narrower than the estimate needs."""
    from tdpipe.sampling.sampler import top_candidates

    g = torch.Generator().manual_seed(k)
    x = torch.randn(9, 20000, generator=g) * 4
    x[1] = x[1].bfloat16().float()
    x[2, 50:] = float("-inf")
    x[3, 77], x[3, 9000] = float("nan"), float("inf")
    x[4, 5], x[4, 6], x[4, 7:] = -0.0, 0.0, -5.0
    x[5] = 1.0
    x[6, ::3] = -0.0
    x[6, 1::3] = 0.0
    for t in (x, x[:, :300].contiguous()):
        if k > t.shape[1]:
            continue
        view = torch.cat([t, torch.zeros(t.shape[0], 3)], dim=1)[:, :t.shape[1]]
        got, ref = top_candidates(t, k), top_candidates(view, k)
        want_v, want_i = t.sort(dim=-1, descending=True, stable=True)
        for v, i in (got, ref):
            assert torch.equal(i, want_i[:, :k])
            assert torch.equal(v.nan_to_num(), want_v[:, :k].nan_to_num())
        # listed rows divided by their temperatures, fp32 and bf16, read where they lie: the scaled copy's
        rows, temps = torch.tensor([6, 0, 3, 1]), torch.tensor([0.5, 1.0, 1.7, 0.9])
        for src in (t, t.bfloat16()):
            scaled = src[rows].float() / temps[:, None]
            want_v, want_i = scaled.sort(dim=-1, descending=True, stable=True)
            for v, i in (top_candidates(src, k, rows, temps), top_candidates(src[:, :].t().contiguous().t(), k, rows,
                                                                            temps)):
                assert torch.equal(i, want_i[:, :k]) and torch.equal(v.nan_to_num(), want_v[:, :k].nan_to_num())


def test_seeded_top_k_rows_draw_the_same_with_or_without_the_kernels(monkeypatch):
    """The kernels (race, candidates) and their torch fallbacks give a seeded request the same tokens, the
    rows read in place (top-k and plain rows) or from the changed copy (a repetition penalty)."""
    g = torch.Generator().manual_seed(8)
    logits = (torch.randn(6, 5000, generator=g) * 3).bfloat16().float()  # ties among the candidates
    params = [SamplingParams(temperature=0.7, top_k=40, seed=i, repetition_penalty=1.2 if i == 3 else 1.0)
              if i % 2 else SamplingParams(temperature=1.2, seed=i) for i in range(6)]
    keys = [draw_key(i, 2) for i in range(6)]
    with_kernels = Sampler().sample(logits, _meta(params, keys))[0]
    monkeypatch.setattr(cpu_ops, "kernel", lambda: None)
    assert Sampler().sample(logits, _meta(params, keys))[0] == with_kernels
