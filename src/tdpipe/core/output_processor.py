"""Token ids in, text out: the frontend's half of a request (vLLM v1's OutputProcessor).

The engine core works in token ids only (core/delta.py); detokenising and stop strings happen here, in the
process that owns the tokenizer: the `LLM` class's process offline, the server's frontend process online
(gLLM §3.3: the frontend is decoupled from the scheduler). A stop string ends a sample here; the caller
then tells the core to drop it (`stopped` in `process`'s result).

A request with n > 1 (or best_of) has one `SampleState` per sequence the core runs; it is finished when
every sample is. best_of > n keeps the n samples with the highest cumulative logprob (vLLM's ranking).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from tdpipe.core.delta import RequestDelta, TokenLogprobs
from tdpipe.core.sample_group import select_best
from tdpipe.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tdpipe.tokenizer import IncrementalDetokenizer, find_stop

SampleId = tuple[str, int]  # (request id, sample index): what the core aborts when a stop string ends a sample


@dataclass(eq=False)
class SampleState:
    index: int
    detok: IncrementalDetokenizer | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stop_hold: int = 0  # characters held back while streaming: they may begin a stop string
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    def output(self, tokenizer: Any, index: int | None = None) -> CompletionOutput:
        text = self.text
        if self.stop_hold and not self.finished:
            text = text[:max(0, len(text) - self.stop_hold)]
        return CompletionOutput(self.index if index is None else index, text, list(self.token_ids),
                                self.finish_reason, self.stop_reason, self.cumulative_logprob,
                                None if self.logprobs is None else list(self.logprobs))


@dataclass(eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: Any  # SamplingParams
    arrival_time: float
    samples: list[SampleState] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        samples = self.samples  # read for every delta: one sample needs no generator
        return samples[0].finished if len(samples) == 1 else all(s.finished for s in samples)

    def output(self, tokenizer: Any) -> RequestOutput:
        samples = self.samples
        n = self.params.n
        if len(samples) > n:  # best_of: the n most likely, best first, numbered 0..n-1
            ranked = select_best(samples, n, lambda s: s.cumulative_logprob)
            outs = [s.output(tokenizer, i) for i, s in enumerate(ranked)]
        else:
            outs = [s.output(tokenizer) for s in samples]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, finished=self.finished,
                             metrics=RequestMetrics(self.arrival_time, self.first_token_time, self.finish_time,
                                                    self.num_preemptions),
                             prompt_logprobs=self.prompt_logprobs, num_cached_tokens=self.num_cached_tokens)


class OutputProcessor:
    """`stream=True` (the server): text is decoded every step and every request that advanced gets a
    RequestOutput with its text so far. `stream=False` (offline `generate`): only requests with stop strings
    are decoded as they go; the others are decoded once, when they finish, and only finished ones are returned."""

    def __init__(self, tokenizer: Any | None, stream: bool, clock: Callable[[], float] = time.time) -> None:
        self.tokenizer = tokenizer
        self.stream = stream
        self.clock = clock
        self.requests: dict[str, RequestState] = {}
        self._tok_text: dict[int, str] = {}  # token id -> its text, for Logprob.decoded_token

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: Any,
                    arrival_time: float | None = None) -> RequestState:
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        st = RequestState(request_id, prompt, prompt_token_ids, params,
                          self.clock() if arrival_time is None else arrival_time)
        for i in range(params.num_samples):
            s = SampleState(i)
            if self.tokenizer is not None and (self.stream or params.stop) and params.detokenize:
                s.detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
                if self.stream and params.stop and not params.include_stop_str_in_output:
                    s.stop_hold = max(len(x) for x in params.stop) - 1
            if params.logprobs is not None:
                s.logprobs = []
            st.samples.append(s)
        self.requests[request_id] = st
        return st

    def process(self, deltas: list[RequestDelta]) -> tuple[list[RequestOutput], list[SampleId]]:
        """Apply one step's deltas. Returns (outputs, stopped): the outputs to hand out (every request that
        advanced when streaming, else the finished ones) and the (request id, sample index) of samples a
        stop string finished, which the core must abort. Deltas of unknown (already finished or aborted)
        requests are ignored."""
        touched, stopped = self.advance(deltas)
        outs = [st.output(self.tokenizer) for st in touched if self.stream or st.finished]
        return outs, stopped

    def advance(self, deltas: list[RequestDelta]) -> tuple[list[RequestState], list[SampleId]]:
        """`process` without building outputs: the states of the requests that advanced (finished ones are
        forgotten here, their state stays valid) and the stopped samples. AsyncLLM renders an output only
        when a reader asks for it (core/output_collector.py), so an unread stream costs nothing per step."""
        stopped: list[SampleId] = []
        now = self.clock()
        touched: dict[str, RequestState] = {}
        for d in deltas:
            st = self.requests.get(d.request_id)
            if st is None or d.index >= len(st.samples):
                continue
            s = st.samples[d.index]
            if s.finished:
                continue
            touched[d.request_id] = st
            if st.first_token_time is None and d.new_token_ids:
                st.first_token_time = now
            st.num_preemptions = max(st.num_preemptions, d.num_preemptions)
            if d.num_cached_tokens is not None:
                st.num_cached_tokens = d.num_cached_tokens
            text = st.params.detokenize
            if d.prompt_logprobs is not None and st.prompt_logprobs is None:
                st.prompt_logprobs = [None if e is None else self._logprob_dict(e, text) for e in d.prompt_logprobs]
            s.token_ids.extend(d.new_token_ids)
            if d.logprobs is not None and s.logprobs is not None:
                s.logprobs.extend(self._logprob_dict(e, text) for e in d.logprobs)
            if d.cumulative_logprob is not None:
                s.cumulative_logprob = d.cumulative_logprob
            if s.detok is not None:
                old = len(s.text)
                s.text += s.detok.add(d.new_token_ids)
                if st.params.stop and (hit := find_stop(s.text, old, st.params.stop)) is not None:
                    i, stop = hit
                    s.text = s.text[:i + len(stop) if st.params.include_stop_str_in_output else i]
                    s.finished, s.finish_reason, s.stop_reason = True, "stop", stop
                    if not d.finished:
                        stopped.append((d.request_id, d.index))
            if d.finished and not s.finished:
                s.finished, s.finish_reason, s.stop_reason = True, d.finish_reason, d.stop_reason
            if s.finished:
                self._finish_sample(st, s)
        for st in touched.values():
            if st.finished:
                del self.requests[st.request_id]
                st.finish_time = now
        return list(touched.values()), stopped

    def render(self, st: RequestState) -> RequestOutput:
        """The request's output now (cumulative text and ids)."""
        return st.output(self.tokenizer)

    def _finish_sample(self, st: RequestState, s: SampleState) -> None:
        if self.tokenizer is not None and not isinstance(s.stop_reason, str) and st.params.detokenize:
            # the whole output decoded once: exactly the text a one-shot decode gives (no window effects)
            full = self.tokenizer.decode(s.token_ids, skip_special_tokens=st.params.skip_special_tokens)
            if s.detok is None or full.startswith(s.text):  # never take back text already streamed
                s.text = full

    def _logprob_dict(self, entry: TokenLogprobs, text: bool = True) -> dict[int, Logprob]:
        """(token, logprob, rank) triples -> vLLM's {token id: Logprob}, each token's text decoded once
        (`text` False, detokenize=False: decoded_token None, as vLLM leaves it)."""
        out: dict[int, Logprob] = {}
        for tok, lp, rank in entry:
            if tok not in out:
                out[tok] = Logprob(lp, rank, self._decoded(tok) if text else None)
        return out

    def _decoded(self, tok: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._tok_text.get(tok)
        if text is None:
            text = self._tok_text[tok] = self.tokenizer.decode([tok])
        return text

    def abort(self, request_id: str) -> RequestOutput | None:
        """Forget a request (client gone, or aborted by the caller); its final output, finish_reason "abort"."""
        st = self.requests.pop(request_id, None)
        if st is None:
            return None
        for s in st.samples:
            if not s.finished:
                s.finished, s.finish_reason = True, "abort"
        st.finish_time = self.clock()
        return st.output(self.tokenizer)

    def has_unfinished(self) -> bool:
        return bool(self.requests)
