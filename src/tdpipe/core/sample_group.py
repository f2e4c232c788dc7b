"""The samples of one request (vLLM's ParentRequest): forks, per-sample aborts, best_of selection.

A request with n > 1 (or best_of) starts as one sequence, sample 0, which carries the shared prompt. When
its prompt is prefilled, its first token is drawn once per sample from the same logits (each sample with
its own seed: sampling/seeds.py), and samples 1.. are forked from it: they share its KV blocks and decode
beside it. The group is the one place that knows which samples exist, which are still to fork and which
were aborted before their fork; the engine, the sampler rows and the scheduler ask it. Every request has
one (a group of one sample when n = 1).
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Callable, TypeVar

from tdpipe.core.delta import TokenLogprobs
from tdpipe.sequence import Sequence

T = TypeVar("T")
SampleId = tuple[str, int]  # (request id, sample index): one sample of a request (LLMEngine.abort_samples)


class SampleGroup:
    def __init__(self, head: Sequence) -> None:
        self.request_id = head.request_id
        self.samples: list[Sequence] = [head]  # forked so far, sample 0 first
        self.unforked: list[int] = list(range(1, head.sampling_params.num_samples))  # forked at the first token
        self.cancelled: set[int] = set()  # unforked samples aborted: never forked (their prompt is shared)
        self.new_forks: list[tuple[Sequence, int]] = []  # forked by the last draw, for the scheduler to place
        self.grammar: Future | None = None  # structured_outputs: the compiled grammar (sampling/grammar.py)
        head.group = self

    @property
    def head(self) -> Sequence:
        return self.samples[0]

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.samples)

    def num_unforked(self, seq: Sequence) -> int:
        """Samples `seq` will fork (counted against max_num_seqs before they exist)."""
        return len(self.unforked) if seq is self.head else 0

    def draws(self, seq: Sequence) -> list[int]:
        """The sample indices `seq`'s next token is drawn for: its own, and at the head's first token those
        of the samples it forks then."""
        if seq is not self.head or not self.unforked:
            return [seq.sample_index]
        return [seq.sample_index] + [k for k in self.unforked if k not in self.cancelled]

    def fork(self, seq_id: int, index: int, token: int, logprobs: TokenLogprobs | None, base: float) -> Sequence:
        """Sample `index`, forked from the head with its own first token: same prompt, outputs and KV position
        (the scheduler shares the blocks when it takes the fork). `base`: the head's cumulative logprob
        before its own first token."""
        h = self.head
        child = Sequence(seq_id, h.request_id, h.prompt_token_ids, h.sampling_params, prompt=h.prompt,
                         max_tokens=h.max_tokens, output_token_ids=list(h.output_token_ids), status=h.status,
                         num_computed_tokens=h.num_computed_tokens, predicted_output_len=h.predicted_output_len,
                         arrival_time=h.arrival_time, first_token_time=h.first_token_time, sample_index=index,
                         group=self, cumulative_logprob=base + (logprobs[0][1] if logprobs is not None else 0.0),
                         num_cached_tokens=h.num_cached_tokens, block_hashes=list(h.block_hashes))
        self.samples.append(child)
        self.new_forks.append((child, token))
        return child

    def take_forks(self, seq: Sequence) -> list[tuple[Sequence, int]]:
        """The scheduler, at `seq`'s sampled token: the samples forked off it with their first tokens; after
        the head's first token nothing is left to fork."""
        if seq is not self.head:
            return []
        forks, self.new_forks, self.unforked = self.new_forks, [], []
        return forks

    def abort(self, index: int | None = None) -> list[Sequence]:
        """The live samples an abort of the whole request (index None) or of sample `index` finishes. A sample
        not forked yet is cancelled instead (it never will be) and nothing is returned for it; sample 0 before
        the fork takes the request with it, since it carries the shared prompt."""
        head = self.head
        if index is not None and index > 0 and self.unforked and not head.is_finished:
            self.cancelled.add(index)
            return []
        out = [s for s in self.samples if not s.is_finished and index in (None, s.sample_index)]
        if head in out:
            self.unforked = []  # an aborted head forks nothing
        return out


def apply_draws(samples: list[tuple[Sequence, int]], tokens: list[int], logprobs: list[TokenLogprobs | None],
                new_seq_id: Callable[[], int]) -> tuple[list[int], list[TokenLogprobs | None],
                                                       dict[int, list[tuple[Sequence, int, TokenLogprobs | None]]]]:
    """One draw per (sequence, sample index), as `SampleGroup.draws` listed them: each sequence's own token
    (and its cumulative logprob), and the forks of heads drawing for their other samples. Returns the tokens
    and logprobs per sequence and, per forking head's seq_id, its children with their first token."""
    out_t: list[int] = []
    out_lp: list[TokenLogprobs | None] = []
    forks: dict[int, list[tuple[Sequence, int, TokenLogprobs | None]]] = {}
    base = 0.0
    for (s, k), t, lp in zip(samples, tokens, logprobs):
        if k == s.sample_index:  # listed before its forks: base is the value they fork from
            base = s.cumulative_logprob
            out_t.append(t)
            out_lp.append(lp)
            if lp is not None:
                s.cumulative_logprob += lp[0][1]
        else:
            child = s.group.fork(new_seq_id(), k, t, lp, base)
            forks.setdefault(s.seq_id, []).append((child, t, lp))
    return out_t, out_lp, forks


def select_best(samples: list[T], n: int, cumulative_logprob: Callable[[T], float | None]) -> list[T]:
    """best_of: the n samples with the highest cumulative logprob, best first (vLLM's ranking)."""
    return sorted(samples, key=lambda s: -(cumulative_logprob(s) or 0.0))[:n]


__all__ = ["SampleGroup", "SampleId", "apply_draws", "select_best"]
