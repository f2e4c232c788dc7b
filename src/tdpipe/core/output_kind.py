"""SamplingParams.output_kind applied to a request's stream (vLLM's RequestOutputKind): the engine's frontend
renders the whole output so far each time a request advances; this turns that into what the caller asked for.

DELTA is cut from the cumulative renders at the moment each one is yielded, so a reader that skipped some
renders (the collector keeps only the newest) still receives every token once: the pieces concatenate to the
cumulative output. The prompt's logprobs come with the first piece only.
"""
from __future__ import annotations

from dataclasses import replace

from tdpipe.outputs import RequestOutput
from tdpipe.sampling.params import RequestOutputKind


class OutputKindFilter:
    """Call it on each cumulative output in order: the output to yield, or None to yield nothing."""

    def __init__(self, kind: RequestOutputKind) -> None:
        self.kind = kind
        self._sent: dict[int, tuple[int, int]] = {}  # sample index -> (tokens, characters) already yielded
        self._first = True

    def __call__(self, out: RequestOutput) -> RequestOutput | None:
        if self.kind == RequestOutputKind.FINAL_ONLY:
            return out if out.finished else None
        if self.kind == RequestOutputKind.CUMULATIVE:
            return out
        pieces = []
        for c in out.outputs:
            tokens, chars = self._sent.get(c.index, (0, 0))
            pieces.append(replace(c, text=c.text[chars:], token_ids=list(c.token_ids[tokens:]),
                                  logprobs=None if c.logprobs is None else c.logprobs[tokens:]))
            self._sent[c.index] = (len(c.token_ids), len(c.text))
        first, self._first = self._first, False
        return replace(out, outputs=pieces, prompt_logprobs=out.prompt_logprobs if first else None)


__all__ = ["OutputKindFilter"]
