"""`tdpipe serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn, as vLLM).

`build_app(engine, config)` builds the app around an EngineClient (core/engine_client.py: AsyncLLM, or a
test's fake) and starts nothing, so other code (`tdpipe run-batch`, the tests) can drive it in-process
through httpx.ASGITransport. `serve` binds the port, answers /health with 503 while AsyncLLM starts, serves,
and on SIGTERM or Ctrl-C stops accepting, lets the requests in flight finish for up to --shutdown-grace
seconds, aborts the rest, stops the engine, exits 0. If the engine core dies, the open requests fail (503,
or an error event on a stream), the server logs one line and exits 1: a supervisor restarts it, instead of a
server that answers 503 forever.
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import resource
import signal
import socket
import sys
import time
from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from tdpipe import aio
from tdpipe.core.engine_client import EngineClient
from tdpipe.entrypoints.openai.errors import (EngineDeadError, OpenAIError, bad_request, error_body,
                                              from_validation_error)
from tdpipe.entrypoints.openai.metrics import ServerMetrics
from tdpipe.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                DetokenizeResponse, ModelCard, ModelList, TokenizeRequest,
                                                TokenizeResponse, UpdateWeightsRequest)
from tdpipe.entrypoints.openai.ignored_fields import ignored_fields_header
from tdpipe.entrypoints.openai.json_body import (MAX_JSON_DEPTH, depth_over, lone_surrogate_at,
                                                 may_hold_surrogates, parse_json, surrogate_error)
from tdpipe.entrypoints.openai.serving import OpenAIServing
from tdpipe.entrypoints.openai.serving_chat import ChatServing, apply_template
from tdpipe.entrypoints.openai.serving_completion import CompletionServing
from tdpipe.entrypoints.openai.serve_args import ServerConfig
from tdpipe.entrypoints.openai.tokenizer_thread import off_loop
from tdpipe.version import package_version

__all__ = ["ServerConfig", "build_app", "set_engine", "run_server", "serve"]

log = logging.getLogger("tdpipe.serve")

M = TypeVar("M", bound=BaseModel)

BODY_READ_TIMEOUT_S = 60.0  # a client that stops sending its body mid-way gets 408 and loses its connection
# a connection that sends no request at all is closed after this long: generous, because under a burst of
# new connections a busy event loop may read a first request late, and closing then fails a good client
FIRST_REQUEST_TIMEOUT_S = 60.0
UPDATE_WEIGHTS_PATH = "/update_weights_from_disk"  # SGLang's route: {"model_path": FOLDER}
SLOW_SHUTDOWN_S = 5.0  # after the core died: how long the failed requests get to send their answers


# -- the app ---------------------------------------------------------------------------------------------
def build_app(engine: EngineClient | None, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app around `engine` (an EngineClient). It starts nothing: no uvicorn, no engine.
    `engine=None` means "starting": /health and the /v1 routes answer 503 until set_engine(app, engine)."""
    config = config or ServerConfig()
    app = FastAPI(title="tdpipe", summary="OpenAI-compatible server", openapi_url=None, docs_url=None,
                  redoc_url=None)
    app.state.engine = engine
    app.state.config = config
    metrics = ServerMetrics(lambda: app.state.engine)
    app.state.metrics = metrics
    serving = OpenAIServing(lambda: app.state.engine, config, metrics)
    app.state.serving = serving
    completion, chat = CompletionServing(serving), ChatServing(serving)
    limit = config.max_request_body_bytes
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    # added last, so outermost: a browser's preflight (OPTIONS) is answered before the key is asked for
    app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                       allow_methods=list(config.allowed_methods), allow_headers=list(config.allowed_headers),
                       allow_credentials=config.allow_credentials)
    if engine is not None:
        _use_chat_template(engine, config)
    _add_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await parse_body(request, CompletionRequest, limit)
        return await completion.handle(req, request) or Response(status_code=499)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await parse_body(request, ChatCompletionRequest, limit)
        return await chat.handle(req, request) or Response(status_code=499)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(ModelList(data=[_model_card(serving)]).model_dump())

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        eng = serving.engine()
        serving.check_model(model, eng)
        return JSONResponse(_model_card(serving).model_dump())

    @app.get("/health")
    async def health() -> Response:
        # no key on this route: the reason is EngineClient's client-safe text, never the core's exception
        eng: EngineClient | None = app.state.engine
        reason = eng.dead_reason if eng is not None else None  # first: a dead engine is not ready either
        if eng is not None and reason is None and eng.ready:
            try:
                eng.check_health()
            except EngineDeadError as e:
                reason = str(e) or "the engine core died"
        if reason is not None:
            return JSONResponse({"status": "dead", "reason": reason}, status_code=503)
        if eng is None or not eng.ready:
            return JSONResponse({"status": "starting"}, status_code=503, headers={"Retry-After": "5"})
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": package_version()})  # vLLM's route: tdpipe's own version here

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = await parse_body(request, TokenizeRequest, limit)
        eng = serving.engine()
        serving.check_model(req.model, eng)
        ignored = serving.ignored(req)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of 'prompt' (text) and 'messages' (a chat)", "prompt")

        def encode() -> list[int]:  # on the tokenizer thread
            tok = eng.tokenizer
            if req.prompt is not None:
                add = True if req.add_special_tokens is None else req.add_special_tokens
                return tok.encode(req.prompt, add_special_tokens=add)
            conv = ChatCompletionRequest(messages=req.messages).conversation()
            add_generation_prompt, continue_final = req.template_flags()
            return apply_template(tok, conv, add_generation_prompt, bool(req.add_special_tokens), continue_final,
                                  req.template_kwargs())

        ids = await off_loop(encode)
        return JSONResponse(TokenizeResponse(tokens=ids, count=len(ids),
                                             max_model_len=int(eng.max_model_len)).model_dump(),
                            headers=ignored_fields_header(ignored))

    @app.post(UPDATE_WEIGHTS_PATH)
    async def update_weights_from_disk(request: Request) -> Response:
        """New weights from a folder without a restart (core/weight_sync.py): requests in flight finish on
        the old weights and later ones wait (in_flight "finish"), or they are paused and recomputed on the new
        ones ("recompute"). Behind the API key, as the /v1 routes."""
        req = await parse_body(request, UpdateWeightsRequest, limit)
        eng = serving.engine()
        update = getattr(eng, "update_weights_from_disk", None)
        if update is None:
            raise OpenAIError(501, "this engine cannot update its weights", None, "not_implemented")
        try:
            version = await update(req.model_path, req.in_flight)
        except ValueError as e:
            raise bad_request(str(e), "model_path") from None
        return JSONResponse({"success": True, "message": f"loaded {req.model_path}", "weight_version": version})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = await parse_body(request, DetokenizeRequest, limit)
        eng = serving.engine()
        serving.check_model(req.model, eng)
        ignored = serving.ignored(req)
        size = int(eng.vocab_size) or len(eng.tokenizer)

        def decode() -> str:  # on the tokenizer thread
            bad = next((t for t in req.tokens if not 0 <= t < size), None)
            if bad is not None:
                raise bad_request(f"'tokens' has {bad}, outside the vocabulary (ids are in [0, {size}))",
                                  "tokens", "invalid_value")
            return eng.tokenizer.decode(req.tokens)

        return JSONResponse(DetokenizeResponse(prompt=await off_loop(decode)).model_dump(),
                            headers=ignored_fields_header(ignored))

    return app


def set_engine(app: FastAPI, engine: EngineClient) -> None:
    """Attach the engine once it has started (serve builds the app first, so /health answers 503
    meanwhile)."""
    _use_chat_template(engine, app.state.config)
    app.state.engine = engine


def _use_chat_template(engine: EngineClient, config: ServerConfig) -> None:
    """--chat-template: the engine's tokenizer renders with it from now on (chat, /tokenize)."""
    if config.chat_template is not None and engine.tokenizer is not None:
        engine.tokenizer.chat_template = config.chat_template


def _model_card(serving: OpenAIServing) -> ModelCard:
    eng = serving.engine()
    return ModelCard(id=serving.served_name(eng), created=int(time.time()),
                     root=eng.model_name or serving.served_name(eng), max_model_len=int(eng.max_model_len))


async def parse_body(request: Request, model: type[M], limit: int) -> M:
    """The body as `model`: 415 for a content type other than JSON (none at all is taken as JSON), 413 over
    `limit` bytes (declared or read), 400 for invalid UTF-8, malformed JSON or an invalid field."""
    ctype = request.headers.get("content-type")
    if ctype is not None:
        mtype, _, rest = ctype.partition(";")
        mtype = mtype.strip().lower()
        charset = next((p.split("=", 1)[1].strip().strip('"').lower() for p in rest.split(";")
                        if p.strip().lower().startswith("charset=")), "utf-8")
        if not (mtype == "application/json" or mtype.endswith("+json")) or charset not in ("utf-8", "utf8"):
            raise OpenAIError(415, f"Content-Type must be application/json (UTF-8), got {ctype!r}",
                              code="unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad_request(f"Content-Length {declared!r} is not a number", code="invalid_request")
        if int(declared) > limit:
            raise OpenAIError(413, f"the request body has {declared} bytes; the limit is {limit} "
                              "(--max-request-body-bytes)", code="request_too_large")
    body = bytearray()
    try:
        async with asyncio.timeout(BODY_READ_TIMEOUT_S):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise OpenAIError(413, f"the request body is over the limit of {limit} bytes "
                                      "(--max-request-body-bytes)", code="request_too_large")
    except TimeoutError:
        raise OpenAIError(408, f"the request body did not arrive within {BODY_READ_TIMEOUT_S:g} s",
                          code="request_timeout", headers={"Connection": "close"}) from None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8 (byte {e.start})",
                          code="invalid_encoding") from None
    if not text.strip():
        raise bad_request("the request body is empty; send a JSON object", code="invalid_json")
    obj = parse_json(text)
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and \
            await off_loop(depth_over, obj, MAX_JSON_DEPTH, tokenizer=False):  # a walk of every container
        raise bad_request(f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)",
                          code="invalid_json")
    if may_hold_surrogates(text) and (where := await off_loop(lone_surrogate_at, obj, tokenizer=False)):
        raise surrogate_error(where)
    if not isinstance(obj, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(obj).__name__}",
                          code="invalid_json")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise from_validation_error(e) from None


class APIKeyMiddleware:
    """Every /v1 route and the weight update need "Authorization: Bearer <key>" (401 otherwise). Compared in
    constant time; the key is never logged. /health, /metrics, /tokenize and /detokenize stay open, as in
    vLLM."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guarded = scope.get("path", "").startswith("/v1") or scope.get("path") == UPDATE_WEIGHTS_PATH
        if scope["type"] != "http" or not guarded or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        msg = "missing API key: send 'Authorization: Bearer <key>'" if not given else "incorrect API key"
        resp = JSONResponse(error_body(401, msg, None, "invalid_api_key"), status_code=401,
                            headers={"WWW-Authenticate": "Bearer"})
        await resp(scope, receive, send)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, e: OpenAIError) -> Response:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> Response:
        route = e.status_code in (404, 405)
        msg = f"no route {request.method} {request.url.path}" if route else str(e.detail)
        return JSONResponse(error_body(e.status_code, msg), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> Response:
        first = (e.errors() or [{}])[0]
        param = ".".join(str(x) for x in first.get("loc", ()) if x not in ("body", "query", "path")) or None
        return JSONResponse(error_body(400, f"Invalid value for '{param}': {first.get('msg')}", param),
                            status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> Response:
        log.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=e)
        return JSONResponse(error_body(500, f"internal server error: {type(e).__name__}"), status_code=500)


# -- tdpipe serve ----------------------------------------------------------------------------------------
def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a port in use fails in a second, not after."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, proto, _, addr = infos[0]
    # proto = IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted connections only then; with 0, Nagle holds
    # streamed chunks on a keep-alive connection back ~40 ms and they arrive together
    sock = socket.socket(family, socket.SOCK_STREAM, proto or socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def is_loopback(addr: str) -> bool:
    """Whether a bound address is reachable from this machine only (127.0.0.0/8, ::1)."""
    try:
        ip = ipaddress.ip_address(addr.split("%")[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def warn_if_open(config: ServerConfig, sock: socket.socket) -> bool:
    """A warning when the port is reachable beyond this machine and no API key guards the /v1 routes."""
    host, port = sock.getsockname()[:2]
    if config.api_key or is_loopback(host):
        return False
    log.warning("listening on %s:%d, beyond this machine, without --api-key: anyone who reaches the port can "
                "run the model (set --api-key or $TDPIPE_API_KEY, or --host 127.0.0.1)", host, port)
    return True


def raise_fd_limit(connections: int) -> None:
    """Each connection is a file descriptor: lift the soft limit towards what --max-connections needs (the
    engine's sockets and files need some too), as far as the hard limit allows."""
    need = connections + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    want = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    if want < need:
        log.warning("the open-files limit (%d) is below what --max-connections %d needs (%d): connections "
                    "beyond it are refused by the kernel", want, connections, need)


def run_server(config: ServerConfig, engine_config: Any) -> int:
    """`tdpipe serve`: bind, start the engine, serve until SIGTERM/Ctrl-C (exit 0) or until the engine core
    dies (exit 1)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    sock = bind(config.host, config.port)
    warn_if_open(config, sock)
    raise_fd_limit(config.max_connections)
    # uvicorn catches SIGINT/SIGTERM while it serves and raises them again once it has shut down; these
    # handlers take that second delivery, so a clean shutdown exits 0 instead of dying by the signal
    previous = {s: signal.signal(s, _after_shutdown) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return aio.run(serve(engine_config, config, sock))
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _after_shutdown(signum: int, frame: object) -> None:
    log.debug("signal %d after shutdown (uvicorn passes on the one it caught)", signum)


def uvicorn_config(app: FastAPI, config: ServerConfig) -> Any:
    """uvicorn's settings for `tdpipe serve`. limit_concurrency: beyond --max-connections open connections
    (or requests in flight) uvicorn answers 503 at once. Connections that send nothing are closed after
    FIRST_REQUEST_TIMEOUT_S (uvicorn arms its keep-alive timer only after a first response), so idle sockets
    cannot hold every place of the limit; after a response, after --timeout-keep-alive idle seconds."""
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class IdleClosingProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.timeout_keep_alive_task = self.loop.call_later(FIRST_REQUEST_TIMEOUT_S,
                                                                self.timeout_keep_alive_handler)

    return uvicorn.Config(app, lifespan="off", access_log=config.access_log, http=IdleClosingProtocol,
                          timeout_graceful_shutdown=config.shutdown_grace_s,
                          timeout_keep_alive=config.timeout_keep_alive_s,
                          limit_concurrency=config.max_connections, log_level=config.uvicorn_log_level)


async def serve(engine_config: Any, config: ServerConfig, sock: socket.socket) -> int:
    """Serve until SIGTERM/Ctrl-C (returns 0) or the engine core's death (returns 1, after the open requests
    got their error). The port answers at once (/health: 503 while the engine starts)."""
    import uvicorn

    from tdpipe.core.data_parallel import start_engine_client
    from tdpipe.frozen_heap import freeze_heap

    app = build_app(None, config)
    server = uvicorn.Server(uvicorn_config(app, config))
    server_task = asyncio.ensure_future(server.serve(sockets=[sock]))
    start_task = asyncio.ensure_future(start_engine_client(engine_config))  # AsyncLLM, or N replicas
    await asyncio.wait({server_task, start_task}, return_when=asyncio.FIRST_COMPLETED)
    if not start_task.done():  # a signal while the model loads: let it finish loading, then stop it
        # (cancelling the start would leave the core process loading with nobody to stop it)
        await asyncio.gather(server_task, return_exceptions=True)
        done = (await asyncio.gather(start_task, return_exceptions=True))[0]
        if not isinstance(done, BaseException):
            await done.shutdown(grace_s=0)
        return 0
    if start_task.exception() is not None:
        server.should_exit = True
        await asyncio.gather(server_task, return_exceptions=True)
        if isinstance(start_task.exception(), EngineDeadError):  # the core says why (a model folder, a
            print(f"tdpipe: error: {start_task.exception()}", file=sys.stderr, flush=True)  # flag): one line
            return 1
        raise start_task.exception()  # type: ignore[misc]
    engine = start_task.result()
    engine.log_death = False  # a death is reported below, in one line
    set_engine(app, engine)
    freeze_heap()  # a full collection over the start-up heap would freeze the event loop
    host, port = sock.getsockname()[:2]
    print(f"tdpipe: serving {app.state.serving.served_name(engine)} on http://{host}:{port} (max_model_len "
          f"{engine.max_model_len})", file=sys.stderr, flush=True)
    death = asyncio.ensure_future(engine.wait_dead())
    try:
        await asyncio.wait({server_task, death}, return_when=asyncio.FIRST_COMPLETED)
        if death.done() and not server_task.done():
            # every open request already has its EngineDeadError: let them answer (503, an error event),
            # then stop serving, so a supervisor restarts the server instead of it answering 503 forever
            left = [t for t in server.server_state.tasks if not t.done()]
            if left:
                await asyncio.wait(left, timeout=SLOW_SHUTDOWN_S)
            server.should_exit = True
        await server_task
        # uvicorn waited up to the grace period, then cancelled what was left: let those end their
        # responses (a final error event) and close their engine requests (which aborts them)
        left = [t for t in server.server_state.tasks if not t.done()]
        if left:
            _, left = await asyncio.wait(left, timeout=5)
        for t in left:  # a second Ctrl-C makes uvicorn stop waiting without cancelling them
            t.cancel()
        await asyncio.gather(*left, return_exceptions=True)
    finally:
        death.cancel()
        t0 = time.monotonic()
        await engine.shutdown(grace_s=0.0 if engine.death_detail else 1.0)
        if engine.death_detail is None:
            log.info("engine stopped in %.1f s", time.monotonic() - t0)
    if engine.death_detail is not None:
        log.error("the engine core died (%s); %d open requests failed; exiting with status 1",
                  engine.death_detail, engine.failed_on_death)
        return 1
    return 0
