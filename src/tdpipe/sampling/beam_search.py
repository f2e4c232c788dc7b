"""vLLM's offline beam search (`LLM.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=32))`),
built on the engine as vLLM builds it: each step asks for one token with the top 2 x beam_width
log-probabilities of every live beam, in one batch for all prompts, and keeps the beam_width best
continuations per prompt. Prefix caching keeps each step from recomputing the beams' shared prefixes.

Beams are ranked by cumulative log-probability over length ** length_penalty, the length counting the prompt
and the output but not a final EOS (vLLM's get_beam_search_score). A beam that ends with EOS (unless
ignore_eos) is finished; the search stops after max_tokens steps or when no beam is left alive.
"""
from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from tdpipe.outputs import Logprob
from tdpipe.sampling.params import SamplingParams


@dataclass
class BeamSearchParams:
    """vLLM's names and defaults."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # accepted for vLLM's signature; beams stop on EOS only

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        for name in ("temperature", "length_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")

    def step_params(self) -> SamplingParams:
        """One step of every beam: one token and the 2 x beam_width most likely next tokens' logprobs."""
        return SamplingParams(temperature=self.temperature, max_tokens=1, logprobs=2 * self.beam_width,
                              ignore_eos=True, detokenize=False)


@dataclass
class BeamSearchSequence:
    """One beam: its tokens (the prompt's, then the output's), one logprob entry per output token, the
    cumulative logprob of the output, and the decoded text of all its tokens (vLLM's fields)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | None = None  # the EOS id it stopped on

    def score(self, eos_token_ids: frozenset[int], length_penalty: float) -> float:
        n = len(self.tokens) - (1 if self.tokens and self.tokens[-1] in eos_token_ids else 0)
        return self.cum_logprob / (n ** length_penalty)


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first, at most beam_width


# one engine step: token-id prompts in, each one's {token id: Logprob} of its next position out
StepFn = Callable[[list[list[int]]], list[dict[int, Logprob]]]
AsyncStepFn = Callable[[list[list[int]]], Awaitable[list[dict[int, Logprob]]]]


class BeamSearch:
    """The search as a state the caller drives: `pending()` the token lists of the live beams (one engine
    step each), `advance()` with their next-position logprobs, until `pending()` is empty; then `outputs()`.
    The offline driver (beam_search) and the server's (beam_search_async) differ only in how a step runs."""

    def __init__(self, prompts: Sequence[list[int]], params: BeamSearchParams, eos_token_ids: frozenset[int],
                 max_len: int) -> None:
        self.params, self.eos, self.max_len = params, eos_token_ids, max_len
        self.live = [[BeamSearchSequence(list(p))] for p in prompts]
        self.done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.steps = 0
        self._flat: list[tuple[int, BeamSearchSequence]] = []

    def _score(self, b: BeamSearchSequence) -> float:
        return b.score(self.eos, self.params.length_penalty)

    def pending(self) -> list[list[int]]:
        """The next step's prompts (every live beam's tokens); [] once the search is over."""
        self._flat = [] if self.steps >= self.params.max_tokens else \
            [(i, b) for i, beams in enumerate(self.live) for b in beams]
        return [b.tokens for _, b in self._flat]

    def advance(self, nexts: list[dict[int, Logprob]]) -> None:
        """Each pending beam's candidates: keep the beam_width best per prompt, retire finished ones."""
        self.steps += 1
        grown: list[list[BeamSearchSequence]] = [[] for _ in self.live]
        for (i, beam), entry in zip(self._flat, nexts, strict=True):
            for tok, lp in entry.items():
                child = BeamSearchSequence(beam.tokens + [tok], beam.logprobs + [entry],
                                           beam.cum_logprob + lp.logprob)
                if tok in self.eos and not self.params.ignore_eos:
                    child.finish_reason, child.stop_reason = "stop", tok
                    self.done[i].append(child)
                else:
                    grown[i].append(child)
        for i, children in enumerate(grown):
            children.sort(key=self._score, reverse=True)
            self.live[i] = children[:self.params.beam_width]
            for b in self.live[i]:
                if len(b.tokens) >= self.max_len:
                    b.finish_reason = "length"
            self.done[i] += [b for b in self.live[i] if b.finish_reason]
            self.live[i] = [b for b in self.live[i] if not b.finish_reason]

    def outputs(self, decode: Callable[[list[int]], str] | None = None) -> list[BeamSearchOutput]:
        outs = []
        for i in range(len(self.live)):
            for b in self.live[i]:
                b.finish_reason = "length"
            ranked = sorted(self.done[i] + self.live[i], key=self._score, reverse=True)[:self.params.beam_width]
            if decode is not None:
                for b in ranked:
                    b.text = decode(b.tokens)
            outs.append(BeamSearchOutput(ranked))
        return outs


def beam_search(prompts: Sequence[list[int]], params: BeamSearchParams, step: StepFn,
                eos_token_ids: frozenset[int], max_len: int,
                decode: Callable[[list[int]], str] | None = None) -> list[BeamSearchOutput]:
    """The beam search over token-id prompts. `max_len`: a beam stops (finish_reason "length") when its
    tokens reach the model's max_model_len."""
    search = BeamSearch(prompts, params, eos_token_ids, max_len)
    while batch := search.pending():
        search.advance(step(batch))
    return search.outputs(decode)


async def beam_search_async(prompts: Sequence[list[int]], params: BeamSearchParams, step: AsyncStepFn,
                            eos_token_ids: frozenset[int], max_len: int,
                            decode: Callable[[list[int]], str] | None = None) -> list[BeamSearchOutput]:
    """beam_search with a step that awaits the engine (the server's engine client)."""
    search = BeamSearch(prompts, params, eos_token_ids, max_len)
    while batch := search.pending():
        search.advance(await step(batch))
    return search.outputs(decode)


__all__ = ["BeamSearch", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "beam_search",
           "beam_search_async"]
