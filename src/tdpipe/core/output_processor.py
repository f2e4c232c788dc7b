"""Token ids in, text out: the frontend's half of a request (vLLM v1's OutputProcessor).

The engine core works in token ids only (core/delta.py); detokenising and stop strings happen here, in the
process that owns the tokenizer: the `LLM` class's process offline, the server's frontend process online
(gLLM §3.3: the frontend is decoupled from the scheduler). A stop string ends a request here; the caller
then tells the core to drop it (`stopped` in `process`'s result).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from tdpipe.core.delta import RequestDelta
from tdpipe.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tdpipe.tokenizer import IncrementalDetokenizer, find_stop


@dataclass(eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: Any  # SamplingParams
    arrival_time: float
    detok: IncrementalDetokenizer | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    stop_hold: int = 0  # characters held back while streaming: they may begin a stop string

    def output(self) -> RequestOutput:
        text = self.text
        if self.stop_hold and not self.finished:
            text = text[:max(0, len(text) - self.stop_hold)]
        comp = CompletionOutput(0, text, list(self.token_ids), self.finish_reason, self.stop_reason)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [comp], finished=self.finished,
                             metrics=RequestMetrics(self.arrival_time, self.first_token_time, self.finish_time,
                                                    self.num_preemptions))


class OutputProcessor:
    """`stream=True` (the server): text is decoded every step and every request that advanced gets a
    RequestOutput with its text so far. `stream=False` (offline `generate`): only requests with stop strings
    are decoded as they go; the others are decoded once, when they finish, and only finished ones are returned."""

    def __init__(self, tokenizer: Any | None, stream: bool, clock: Callable[[], float] = time.time) -> None:
        self.tokenizer = tokenizer
        self.stream = stream
        self.clock = clock
        self.requests: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: Any,
                    arrival_time: float | None = None) -> RequestState:
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        st = RequestState(request_id, prompt, prompt_token_ids, params,
                          self.clock() if arrival_time is None else arrival_time)
        if self.tokenizer is not None and (self.stream or params.stop):
            st.detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
            if self.stream and params.stop and not params.include_stop_str_in_output:
                st.stop_hold = max(len(s) for s in params.stop) - 1
        self.requests[request_id] = st
        return st

    def process(self, deltas: list[RequestDelta]) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's deltas. Returns (outputs, stopped): the outputs to hand out (every request that
        advanced when streaming, else the finished ones) and the ids of requests a stop string finished,
        which the core must abort. Deltas of unknown (already finished or aborted) requests are ignored."""
        outs: list[RequestOutput] = []
        stopped: list[str] = []
        now = self.clock()
        for d in deltas:
            st = self.requests.get(d.request_id)
            if st is None:
                continue
            if st.first_token_time is None and d.new_token_ids:
                st.first_token_time = now
            st.num_preemptions = d.num_preemptions
            st.token_ids.extend(d.new_token_ids)
            if st.detok is not None:
                old = len(st.text)
                st.text += st.detok.add(d.new_token_ids)
                if st.params.stop and (hit := find_stop(st.text, old, st.params.stop)) is not None:
                    i, s = hit
                    st.text = st.text[:i + len(s) if st.params.include_stop_str_in_output else i]
                    st.finished, st.finish_reason, st.stop_reason = True, "stop", s
                    if not d.finished:
                        stopped.append(d.request_id)
            if d.finished and not st.finished:
                st.finished, st.finish_reason, st.stop_reason = True, d.finish_reason, d.stop_reason
            if st.finished:
                self._finish(st, now)
                outs.append(st.output())
            elif self.stream:
                outs.append(st.output())
        return outs, stopped

    def _finish(self, st: RequestState, now: float) -> None:
        del self.requests[st.request_id]
        st.finish_time = now
        if self.tokenizer is not None and not isinstance(st.stop_reason, str):
            # the whole output decoded once: exactly the text a one-shot decode gives (no window effects)
            full = self.tokenizer.decode(st.token_ids, skip_special_tokens=st.params.skip_special_tokens)
            if st.detok is None or full.startswith(st.text):  # never take back text already streamed
                st.text = full

    def abort(self, request_id: str) -> RequestOutput | None:
        """Forget a request (client gone, or aborted by the caller); its final output, finish_reason "abort"."""
        st = self.requests.pop(request_id, None)
        if st is None:
            return None
        st.finished, st.finish_reason, st.finish_time = True, "abort", self.clock()
        return st.output()

    def has_unfinished(self) -> bool:
        return bool(self.requests)
