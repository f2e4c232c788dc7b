"""vLLM's beam search (sampling/beam_search.py) on a toy model without an engine: with a beam as wide as
every sequence it finds the exhaustive ranking; EOS ends a beam; the score is vLLM's (cumulative logprob over
the length without a final EOS, to the length_penalty); bad parameters name the field."""
import itertools
import math

import pytest

from tdpipe.outputs import Logprob
from tdpipe.sampling.beam_search import BeamSearchParams, beam_search

EOS = 9
VOCAB = (1, 2, 3, EOS)


def toy_logprobs(tokens: list[int]) -> dict[int, float]:
    """A fixed next-token distribution that depends on the last two tokens."""
    a, b = (tokens[-2:] + [0, 0])[:2] if len(tokens) >= 2 else (0, tokens[-1] if tokens else 0)
    w = {t: 1.0 + ((a * 7 + b * 3 + t * 5) % 11) for t in VOCAB}
    z = sum(w.values())
    return {t: math.log(v / z) for t, v in w.items()}


def step(batch: list[list[int]]) -> list[dict[int, Logprob]]:
    return [{t: Logprob(lp) for t, lp in toy_logprobs(toks).items()} for toks in batch]


def exhaustive(prompt: list[int], max_tokens: int, length_penalty: float) -> list[tuple[float, list[int]]]:
    """Every sequence a beam can end as, scored as vLLM scores it, best first."""
    out = []
    for n in range(1, max_tokens + 1):
        for tail in itertools.product(VOCAB, repeat=n):
            if EOS in tail[:-1] or (n < max_tokens and tail[-1] != EOS):
                continue  # EOS only last; shorter sequences only when they end with EOS
            toks, cum = list(prompt), 0.0
            for t in tail:
                cum += toy_logprobs(toks)[t]
                toks.append(t)
            length = len(toks) - (1 if toks[-1] == EOS else 0)
            out.append((cum / length ** length_penalty, toks))
    return sorted(out, key=lambda x: -x[0])


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_a_beam_as_wide_as_every_sequence_finds_the_exhaustive_ranking(length_penalty):
    prompt = [1, 2]
    params = BeamSearchParams(beam_width=64, max_tokens=3, length_penalty=length_penalty)
    got = beam_search([prompt], params, step, frozenset({EOS}), max_len=100)[0].sequences
    want = exhaustive(prompt, 3, length_penalty)[:64]
    assert [s.tokens for s in got] == [t for _, t in want]
    for s, (score, _) in zip(got, want):
        assert s.score(frozenset({EOS}), length_penalty) == pytest.approx(score)
        assert s.finish_reason == ("stop" if s.tokens[-1] == EOS else "length")
        assert len(s.logprobs) == len(s.tokens) - len(prompt)


def test_narrow_beams_ignore_eos_and_the_length_limit():
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    out = beam_search([[1], [3, 3]], params, step, frozenset({EOS}), max_len=100)
    assert [len(o.sequences) for o in out] == [2, 2]
    assert all(len(s.tokens) == len(p) + 4 for o, p in zip(out, ([1], [3, 3])) for s in o.sequences)
    # the model's context ends the beams: "length" at max_len tokens
    short = beam_search([[1, 2]], BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True), step,
                        frozenset({EOS}), max_len=4)[0].sequences
    assert all(len(s.tokens) == 4 and s.finish_reason == "length" for s in short)


@pytest.mark.parametrize("kw, field", [({"beam_width": 0}, "beam_width"), ({"max_tokens": 1.5}, "max_tokens"),
                                       ({"temperature": -1.0}, "temperature"),
                                       ({"length_penalty": float("nan")}, "length_penalty")])
def test_bad_parameters_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kw})
