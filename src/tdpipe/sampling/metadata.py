"""One micro-batch's sampling inputs, row by row (vLLM's SamplingMetadata, nano-vllm's prepare_sample).

The engine builds one per batch from the sequences it samples and hands it to the `Sampler`; everything a row
needs besides its logits is here: its params, the history penalties read, its random key, the stop tokens it
may not produce yet and how many logprobs it wants. A row is a (sequence, sample index) pair: an n > 1
request's first token draws one row per sample from the same logits (core/sample_group.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

from tdpipe.sampling.bad_words import bad_word_bans
from tdpipe.sampling.params import SamplingParams
from tdpipe.sampling.seeds import draw_keys, sample_seed

# Per row: None = the global RNG, an int = a draw key (seeds.draw_key), a Generator = the caller's stream.
RowRandom = int | torch.Generator | None


def may_argmax(seq: Any) -> bool:
    """Whether the last stage may send this sequence's argmax instead of its logits (SiPipe §5.1): greedy,
    nothing that reshapes the distribution (penalties, a grammar, a stop-token ban before min_tokens), no
    logprobs."""
    p = seq.sampling_params
    return (p.argmax_ok and len(seq.output_token_ids) >= p.min_tokens
            and (p.prompt_logprobs is None or not seq.needs_prompt_logits))


@dataclass
class SamplingMetadata:
    """Per row: `params`; `prompt_ids` / `output_ids`, the history repetition, frequency and presence
    penalties read ([] for a row without penalties); `keys`, its randomness; `banned`, token ids it must not
    produce (stop tokens before min_tokens, a bad word's next token; None: no row has any); `num_logprobs`,
    k for a row that wants its sampled token's logprob and the top-k (None: no row wants any); `bitmask`
    [rows, ceil(V / 32)] int32, the tokens a grammar allows (sampling/grammar.py) in the rows listed in
    `masked_rows`, all ones in the others (None: no row has a grammar)."""

    params: list[SamplingParams]
    prompt_ids: list[list[int]]
    output_ids: list[list[int]]
    keys: list[RowRandom]
    banned: list[list[int]] | None = None
    num_logprobs: list[int | None] | None = None
    bitmask: torch.Tensor | None = None
    masked_rows: list[int] | None = None

    def __len__(self) -> int:
        return len(self.params)

    @classmethod
    def from_samples(cls, samples: list[tuple[Any, int]], eos_token_ids: Iterable[int]) -> "SamplingMetadata":
        """One row per (sequence, sample index). A seeded row's randomness is keyed by (seed of that sample,
        index of the token being sampled), not kept in a per-request generator: a request recomputed after
        preemption samples position i with the same draw as without preemption, and sample i of a request
        is the same whatever shares the batch."""
        seqs = [s for s, _ in samples]
        params = [s.sampling_params for s in seqs]
        eos = sorted(eos_token_ids)
        banned: list[list[int]] = []
        for s, p in zip(seqs, params):  # no stop token before min_tokens; the sampler masks them in its copy
            short = len(s.output_token_ids) < p.min_tokens
            row = ([] if p.ignore_eos else eos) + list(p.stop_token_ids or []) if short else []
            if p.bad_words_token_ids:  # the next token of a bad word the answer is spelling
                row += bad_word_bans(p.bad_words_token_ids, s.output_token_ids)
            banned.append(row)
        hist = [p.needs_penalties for p in params]
        keys: list[RowRandom] = [None] * len(seqs)
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        if seeded:
            drawn = draw_keys([sample_seed(params[i].seed, samples[i][1]) for i in seeded],
                              [len(seqs[i].output_token_ids) for i in seeded])
            for i, k in zip(seeded, drawn):
                keys[i] = k
        ks = [(p.logprobs or 0) if p.needs_logprobs else None for p in params]
        return cls(params, [s.prompt_token_ids if h else [] for s, h in zip(seqs, hist)],
                   [s.output_token_ids if h else [] for s, h in zip(seqs, hist)], keys,
                   banned if any(banned) else None, ks if any(k is not None for k in ks) else None)


__all__ = ["RowRandom", "SamplingMetadata", "may_argmax"]
