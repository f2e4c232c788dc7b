"""What completions and chat share: a request's fields become SamplingParams (checked by core/validation.py,
the one validation the engine client shares), it passes admission control, its prompts are tokenised and
validated off the event loop, and it drives the engine client's `generate`; the outputs come back as one
response or an SSE stream.

The order protects the other clients: the cheap checks and admission (503 when the queue is full) come
before any tokenising, and tokenising and chat templates run on one worker thread, so megabytes of prompt
never freeze the event loop. Every path that stops early (a client that hangs up, an error in one prompt of
a batch, a server shutting down) closes the engine's generators, which aborts the requests in the core and
frees their KV blocks.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tdpipe.core.engine_client import EngineClient
from tdpipe.core.validation import (EngineRequest, RequestError, RequestLimits, check_grammar, check_params,
                                    check_stops, validate_prompt)
from tdpipe.entrypoints.openai.admission import Admission, Ticket
from tdpipe.entrypoints.openai.beam import beam_outputs
from tdpipe.entrypoints.openai.errors import (EngineDeadError, OpenAIError, bad_request, engine_dead,
                                              error_json, from_request_error, from_sampling_error)
from tdpipe.entrypoints.openai.metrics import RequestTimer, ServerMetrics
from tdpipe.entrypoints.openai.ignored_fields import IgnoredFieldsLog, ignored_fields_header, ignored_names
from tdpipe.entrypoints.openai.protocol import UsageInfo, _GenerationRequest, _Request, renamed
from tdpipe.entrypoints.openai.serve_args import ServerConfig
from tdpipe.entrypoints.openai.tokenizer_thread import off_loop
from tdpipe.outputs import RequestOutput
from tdpipe.sampling.beam_search import BeamSearchParams
from tdpipe.sampling.params import SamplingParams

log = logging.getLogger("tdpipe.serve")

DONE = b"data: [DONE]\n\n"


@dataclass
class Item:
    """One prompt of a request: one choice of the response and one (validated) request in the engine."""

    index: int
    request: EngineRequest
    prompt_text: str | None = None  # what echo puts first: the prompt (completions), the last message (chat)
    beam: BeamSearchParams | None = None  # use_beam_search: the search runs instead of the request

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def params(self) -> SamplingParams:
        return self.request.params


@dataclass
class Prepared:
    """A request that passed validation, ready to run."""

    request_id: str
    model: str
    items: list[Item]
    stream: bool
    include_usage: bool = False
    continuous_usage: bool = False
    return_token_ids: bool = False
    ignored: list[str] = field(default_factory=list)  # unknown fields, escaped for a header
    created: int = field(default_factory=lambda: int(time.time()))

    def headers(self) -> dict[str, str]:
        return ignored_fields_header(self.ignored)


class OpenAIServing:
    """Shared by the completions and chat handlers: engine access, parameter building, running, streaming."""

    def __init__(self, get_engine: Callable[[], EngineClient | None], config: ServerConfig,
                 metrics: ServerMetrics) -> None:
        self.get_engine = get_engine
        self.config = config
        self.metrics = metrics
        self.admission = Admission(config.max_waiting_requests)
        self.log_ignored = IgnoredFieldsLog()

    # -- engine and model ------------------------------------------------------------------------------
    def engine(self) -> EngineClient:
        """The engine, or 503 while it starts or after its core died."""
        eng = self.get_engine()
        if eng is not None and eng.dead_reason:  # first: a dead engine is not ready either
            raise engine_dead(eng.dead_reason)
        if eng is None or not eng.ready:
            raise OpenAIError(503, "the engine is starting; retry shortly", code="engine_starting",
                              headers={"Retry-After": "5"})
        return eng

    def served_name(self, eng: EngineClient | None = None) -> str:
        if self.config.served_model_name:
            return self.config.served_model_name
        eng = eng if eng is not None else self.get_engine()
        return (eng.model_name if eng is not None else None) or "tdpipe"

    def check_model(self, model: str | None, eng: EngineClient) -> str:
        """404 unless `model` is omitted or the served name."""
        name = self.served_name(eng)
        if model is not None and model != name:
            shown = model if len(model) <= 100 else model[:97] + "..."
            raise OpenAIError(404, f"The model '{shown}' does not exist; this server serves '{name}'",
                              "model", "model_not_found")
        return name

    def ignored(self, req: _Request) -> list[str]:
        """The request's ignorable unknown fields, escaped (named in the answer's header), logged sparingly."""
        names = ignored_names(req)
        self.log_ignored(names)
        return names

    # -- parameters ------------------------------------------------------------------------------------
    def common_checks(self, req: _GenerationRequest, eng: EngineClient) -> tuple[str, list[str]]:
        """The cheap checks, before admission: model, unknown fields, stream options, n. Returns the served
        name and the ignored fields."""
        name = self.check_model(req.model, eng)
        ignored = self.ignored(req)
        req.check_stream_options()
        n = 1 if req.n is None else req.n
        if n < 1:
            raise bad_request(f"n must be >= 1, got {req.n}", "n", "invalid_value")
        if req.stream and req.best_of is not None and req.best_of != n:
            raise bad_request(f"best_of ({req.best_of}) must equal n ({n}) when streaming: the best samples are "
                              "known only once all have finished", "best_of", "invalid_value")
        return name, ignored

    @staticmethod
    def sampling_params(req: _GenerationRequest, max_tokens: int | None, max_field: str,
                        eng: EngineClient) -> SamplingParams:
        """SamplingParams from the request's fields over the model's defaults (vLLM's --generation-config
        auto), checked against the engine (core/validation.py: check_params); every failure is a 400 naming
        the field."""
        defaults = dict(eng.default_sampling)  # the model's generation_config.json (sampling/defaults.py)
        default_max = defaults.pop("max_tokens", None)
        kw = defaults | req.sampling_kwargs()  # what the request sets wins
        if max_tokens is None:
            max_tokens = default_max
        kw["structured_outputs"], _ = req.structured()
        try:
            check_stops(kw.get("stop"), kw.get("stop_token_ids"))  # first: a huge list is not echoed back
            sp = SamplingParams(**kw, max_tokens=max_tokens, logprobs=req.num_logprobs())
            check_params(sp, RequestLimits.of(eng))
        except RequestError as e:
            raise from_request_error(e) from None
        except ValueError as e:  # chat's k is top_logprobs
            raise from_sampling_error(e, {"max_tokens": max_field, "logprobs": req.LOGPROBS_FIELD}) from None
        return sp

    @staticmethod
    def check_grammar(req: _GenerationRequest, sp: SamplingParams) -> None:
        """The output constraint parsed (off the event loop: a schema may be large): a 400 naming the field
        it came from when xgrammar refuses it."""
        try:
            check_grammar(sp)
        except RequestError as e:
            _, field = req.structured()
            raise bad_request(renamed(str(e), sp.structured_outputs.kind, field), field, e.code) from None

    @staticmethod
    def validated(request_id: str, ids: list[int], sp: SamplingParams, eng: EngineClient, prompt_field: str,
                  max_field: str, text: str | None = None) -> EngineRequest:
        """One prompt validated (core/validation.py): ids in the vocabulary, max_tokens resolved to what fits."""
        try:
            return validate_prompt(request_id, ids, sp, RequestLimits.of(eng), text, prompt_field=prompt_field,
                                   max_tokens_field=max_field)
        except RequestError as e:
            raise from_request_error(e) from None

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    # -- running ---------------------------------------------------------------------------------------
    async def admitted(self, eng: EngineClient, n: int, prepare: Callable[[], Prepared], prompt_field: str,
                       tokenizer: bool = True) -> "Run":
        """Admit n prompts (503 when the queue is full), then run `prepare` (tokenising, templating,
        validating) off the event loop (on the tokenizer thread if it uses the tokenizer); returns the run,
        which the caller must close."""
        tickets = self.admission.admit(eng, n)
        try:
            prep = await off_loop(prepare, tokenizer=tokenizer)
        except BaseException:
            for t in tickets:
                t.release()
            raise
        return Run(self, eng, prep, tickets, prompt_field)

    async def until_disconnect(self, receive: Receive, work: Any) -> Any:
        """Await `work` (a coroutine), but cancel it if the client hangs up first (its generators close, which
        aborts its requests). Returns None then: nobody is left to answer."""
        task = asyncio.ensure_future(work)
        stopping, _ = await _race_disconnect(task, receive)
        if stopping:
            raise shutting_down()
        if task.cancelled():
            log.info("client disconnected: request aborted")
            return None
        return task.result()

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
              reasoning_tokens: int | None = None) -> UsageInfo:
        """`cached_tokens`: of the prompt tokens, those the prefix cache held (shown with
        --enable-prompt-tokens-details); `reasoning_tokens`: of the completion tokens, the reasoning's (shown
        where a reasoning parser reads the answers, as vLLM does)."""
        details = {"cached_tokens": cached_tokens} if self.config.enable_prompt_tokens_details else None
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details,
                         completion_tokens_details=(None if reasoning_tokens is None
                                                    else {"reasoning_tokens": reasoning_tokens}))


class Run:
    """The engine requests of one HTTP request: iterate `outputs()` for (choice index, RequestOutput) as they
    advance, from all prompts at once; `close()` aborts whatever has not finished and releases admission."""

    def __init__(self, serving: OpenAIServing, eng: EngineClient, prep: Prepared, tickets: list[Ticket],
                 prompt_field: str) -> None:
        self.serving = serving
        self.eng = eng
        self.prep = prep
        self.tickets = tickets
        self.prompt_field = prompt_field

    def close(self) -> None:
        for t in self.tickets:
            t.release()

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        gens = [self._one(it, self.tickets[k]) for k, it in enumerate(self.prep.items)]
        try:
            async with contextlib.aclosing(_merge(gens)) as merged:
                async for x in merged:
                    yield x
        finally:
            self.close()

    async def _one(self, it: Item, ticket: Ticket) -> AsyncIterator[tuple[int, RequestOutput]]:
        timer: RequestTimer = self.serving.metrics.timer()
        try:
            source = (self.eng.generate(it.request) if it.beam is None else
                      beam_outputs(self.eng, it.request, it.beam))
            async with contextlib.aclosing(source) as gen:
                async for out in gen:
                    ticket.started()
                    timer.tokens_seen(sum(len(c.token_ids) for c in out.outputs))
                    if out.finished:
                        ticket.release()  # done in the engine: a client slow to read its end holds no place
                        for c in out.outputs:
                            if c.finish_reason not in ("stop", "length"):
                                raise OpenAIError(503 if c.finish_reason == "abort" else 500,
                                                  f"the request ended without an answer (finish_reason "
                                                  f"{c.finish_reason!r}{': ' + out.error if out.error else ''})",
                                                  code="request_aborted")
                        timer.finished(out.outputs[0].finish_reason)
                    yield it.index, out
        except EngineDeadError as e:
            raise engine_dead(e) from None
        except RequestError as e:
            raise from_request_error(e) from None
        except ValueError as e:  # the engine refused the request before its first output
            raise bad_request(str(e), self.prompt_field, "invalid_value") from None
        finally:
            ticket.release()


@dataclass
class ChoiceStep:
    """What a choice's next stream chunk carries: its text delta, whether it just finished, and where its
    token ids (and logprobs) not sent yet begin."""

    text: str
    finished: bool
    ids_from: int
    offset: int  # characters of the choice's text sent before this delta


class StreamCursor:
    """Per streamed choice: text and token ids already sent, tokens so far, finished. Completions and chat
    advance their choices the same way; only the chunk they build differs."""

    def __init__(self, num_choices: int) -> None:
        self.sent = [0] * num_choices
        self.ids_sent = [0] * num_choices
        self.tokens = [0] * num_choices
        self.done = [False] * num_choices

    def advance(self, k: int, c: Any) -> ChoiceStep | None:
        """Choice k's output is now c (cumulative): the step to send, or None when nothing is due (finished
        before, or text held back: a possible stop string or a split character)."""
        if self.done[k]:
            return None
        finished = c.finish_reason is not None
        self.tokens[k] = len(c.token_ids)
        delta = c.text[self.sent[k]:]
        if not delta and not finished:
            return None
        step = ChoiceStep(delta, finished, self.ids_sent[k], self.sent[k])
        self.sent[k], self.done[k], self.ids_sent[k] = len(c.text), finished, len(c.token_ids)
        return step


async def _merge(gens: list[AsyncIterator[Any]]) -> AsyncIterator[Any]:
    """Items of several async generators as they come; the first error ends all of them. One generator is
    iterated directly (no task, no queue: the common case costs nothing extra). The queue holds at most one
    item per generator: a consumer that stops reading stops the pumps, so each request's newer outputs
    merge in its engine-side slot instead of piling up here."""
    if len(gens) == 1:
        async with contextlib.aclosing(gens[0]) as g:
            async for x in g:
                yield x
        return
    q: asyncio.Queue = asyncio.Queue(maxsize=len(gens))
    end = object()

    async def pump(g: AsyncIterator[Any]) -> None:
        try:
            async with contextlib.aclosing(g):
                async for x in g:
                    await q.put((x, None))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await q.put((None, e))
            return
        await q.put((end, None))

    tasks = [asyncio.ensure_future(pump(g)) for g in gens]
    try:
        left = len(tasks)
        while left:
            x, err = await q.get()
            if err is not None:
                raise err
            if x is end:
                left -= 1
                continue
            yield x
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _race_disconnect(task: asyncio.Future, receive: Receive) -> tuple[bool, bool]:
    """Wait for `task` or the client hanging up, whichever comes first, then cancel both (a cancelled task
    closes its generators, which aborts its requests in the engine). Returns (stopping, hung_up): stopping
    when uvicorn cancelled the wait (its shutdown grace period is over), hung_up when the client left."""
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    stopping = False
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        stopping = True
    finally:
        for t in (watch, task):
            t.cancel()
        await asyncio.gather(watch, task, return_exceptions=True)
    return stopping, watch.done() and not watch.cancelled()


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def sse_events(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """An SSE body: the events, then `data: [DONE]`. A failure after the stream began (the engine core died,
    the server is stopping, a bug) becomes an error event before [DONE], so the client sees it: never a hang,
    never a cut connection."""
    try:
        async with contextlib.aclosing(events):
            async for e in events:
                yield e
    except Exception as e:  # noqa: BLE001 - OpenAIError carries its own status and code; anything else is a 500
        yield sse_error(e)
    yield DONE


def sse(obj: BaseModel) -> bytes:
    return b"data: " + obj.model_dump_json().encode() + b"\n\n"


def sse_error(e: BaseException) -> bytes:
    """An error as an SSE event: the `openai` client raises an APIError with its message."""
    if isinstance(e, OpenAIError):
        body = error_json(e.status, e.message, e.param, e.code)
    else:  # the details go to the log, not to the client
        log.exception("error while streaming", exc_info=e)
        body = error_json(500, f"internal error while streaming: {type(e).__name__}")
    return b"data: " + body.encode() + b"\n\n"


class SSEResponse(StreamingResponse):
    """An event stream that notices a client hanging up even while no token is due (the request is still
    queued): a watcher on `receive` cancels the stream, whose generators close and abort their requests.
    `on_close` runs in every case, even if the stream never started."""

    def __init__(self, chunks: AsyncIterator[bytes], on_close: Callable[[], None],
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"} | (headers or {}))
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracked(msg: Any) -> None:
            nonlocal started
            started = True
            await send(msg)

        stream = asyncio.ensure_future(self._send_all(tracked))
        try:
            stopping, hung_up = await _race_disconnect(stream, receive)
        finally:
            self.on_close()
        if stopping and not hung_up:
            # end the stream with an error event the client can read, not a cut connection
            log.info("server stopping: a stream was aborted")
            if not started:
                await send({"type": "http.response.start", "status": self.status_code,
                            "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": sse_error(shutting_down()) + DONE,
                        "more_body": False})
        elif stream.cancelled():
            log.info("client disconnected mid-stream: request aborted")

    async def _send_all(self, send: Send) -> None:
        try:
            await self.stream_response(send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def shutting_down() -> OpenAIError:
    return OpenAIError(503, "the server is shutting down: the request was aborted after the grace period",
                       code="server_shutdown", headers={"Retry-After": "5"})
