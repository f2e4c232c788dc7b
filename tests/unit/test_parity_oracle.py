"""The transformers oracle (bench/parity.hf_greedy) across transformers' renaming of the KV-cache keyword:
`past_key_values` until 5.23, `cache` from 5.24 (the old name deprecated, to be removed in 5.40)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from tdpipe.bench.parity import hf_greedy

V = 11


class _Model(torch.nn.Module):
    """Next token = (last token + tokens seen so far, the cached ones included) mod V: a wrong or dropped
    cache changes every answer after the first step."""

    def __init__(self, kw: str) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))  # hf_greedy reads the device from the parameters
        self.kw = kw

    def step(self, input_ids: torch.Tensor, cache: int | None) -> SimpleNamespace:
        seen = (cache or 0) + input_ids.shape[1]
        logits = torch.zeros(1, 1, V)
        logits[0, -1, (int(input_ids[0, -1]) + seen) % V] = 1.0
        return SimpleNamespace(logits=logits, **{self.kw: seen})


class _New(_Model):
    def forward(self, input_ids=None, cache=None, use_cache=None, logits_to_keep=0):  # noqa: D102
        return self.step(input_ids, cache)


class _Old(_Model):
    def forward(self, input_ids=None, past_key_values=None, use_cache=None, logits_to_keep=0):  # noqa: D102
        return self.step(input_ids, past_key_values)


def _expected(prompt: list[int], n: int) -> list[int]:
    seen, last, out = len(prompt), prompt[-1], []
    for _ in range(n):
        last = (last + seen) % V
        out.append(last)
        seen += 1
    return out


def test_the_oracle_passes_the_cache_under_either_keyword():
    prompts = [[1, 2, 3], [7]]
    want = [_expected(p, 5) for p in prompts]
    assert hf_greedy(_New("cache"), prompts, 5) == want
    assert hf_greedy(_Old("past_key_values"), prompts, 5) == want
