"""The server against careless and hostile clients, fast (the fake engine, or AsyncLLM without a core
process): the typed engine contract, one pending output per request, hostile JSON, floats checked as the
sampler's float32 uses them, caps on stops and prompts, admission before tokenising and tokenising off the
event loop, unknown fields named without being remembered or logged raw, a dead core that stops `serve`
(exit 1, one line) and leaks no exception text, the connection limit and the loopback warning."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import logging
import time
import tracemalloc

import httpx
import pytest

from fake_engine_client import OFFSET, FakeAsyncLLM, FakeTokenizer
from tdpipe import frozen_heap
from tdpipe.core import engine_core as core
from tdpipe.core.async_llm import AsyncLLM
from tdpipe.core.delta import RequestDelta
from tdpipe.core.engine_client import EngineClient, EngineDeadError
from tdpipe.core.output_processor import OutputProcessor
from tdpipe.core.validation import (MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, RequestError,
                                    RequestLimits, validate_request)
from tdpipe.entrypoints.openai import api_server
from tdpipe.entrypoints.openai.api_server import ServerConfig, build_app
from tdpipe.entrypoints.openai.ignored_fields import IGNORED_FIELDS_HEADER
from tdpipe.entrypoints.openai.serving import _merge
from tdpipe.sampling.params import SamplingParams

pytestmark = pytest.mark.anyio

C, CHAT = "/v1/completions", "/v1/chat/completions"
U = [{"role": "user", "content": "hi"}]


def _client(engine, **cfg) -> httpx.AsyncClient:
    app = build_app(engine, ServerConfig(**cfg))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def _until(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.002)


def _bad(r: httpx.Response, param: str | None) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err


# -- the typed engine contract ------------------------------------------------------------------------------
def test_async_llm_and_the_fake_satisfy_the_engine_client_protocol():
    for client in (AsyncLLM(None), FakeAsyncLLM()):
        assert isinstance(client, EngineClient)
        for name in ("generate", "abort", "stats", "check_health", "shutdown"):
            want, got = getattr(EngineClient, name), getattr(type(client), name)
            assert list(inspect.signature(want).parameters) == list(inspect.signature(got).parameters), name
            assert inspect.iscoroutinefunction(want) == inspect.iscoroutinefunction(got), name
        assert inspect.isasyncgenfunction(type(client).generate)


def test_one_validation_for_server_and_engine_client():
    limits = RequestLimits(max_model_len=64, max_num_seqs=4, vocab_size=100)
    req = validate_request("r", [5, 6], SamplingParams(max_tokens=None), limits)
    assert req.params.max_tokens == 62 and req.prompt_token_ids == [5, 6]
    for ids, params, param in (([], SamplingParams(), "prompt"), ([100], SamplingParams(), "prompt"),
                               ([1] * 64, SamplingParams(), "prompt"), ([1], SamplingParams(n=5), "n"),
                               ([1], SamplingParams(max_tokens=64), "max_tokens"),
                               ([1], SamplingParams(repetition_penalty=1e-50), "repetition_penalty")):
        with pytest.raises(RequestError) as e:
            validate_request("r", ids, params, limits)
        assert e.value.param == param, e.value


# -- one pending output per request -------------------------------------------------------------------------
def _async_llm_without_a_core() -> tuple[AsyncLLM, list]:
    """AsyncLLM's frontend half, fed core messages by hand (`_on_message`); what it sends is recorded."""
    llm = AsyncLLM(None)
    llm.tokenizer = FakeTokenizer()
    llm.max_model_len, llm.max_num_seqs, llm.vocab_size = 1 << 20, 4, len(llm.tokenizer)
    llm.processor = OutputProcessor(llm.tokenizer, stream=True)
    llm.ready = True
    sent: list = []
    llm._send = lambda *msg: sent.append(msg)
    return llm, sent


async def test_a_reader_that_stops_reading_holds_one_output_not_one_per_step():
    llm, sent = _async_llm_without_a_core()
    renders = 0
    render = llm.processor.render

    def counting(st):
        nonlocal renders
        renders += 1
        return render(st)

    llm.processor.render = counting
    gen = llm.generate([5, 6, 7], SamplingParams(max_tokens=100_000, temperature=0), "r1")
    first = asyncio.ensure_future(gen.__anext__())
    await asyncio.sleep(0)
    assert sent[0][:2] == (core.ADD, "r1")
    tok = OFFSET + ord("a")

    def steps(k: int) -> None:
        for _ in range(k):
            llm._on_message((core.OUT, [RequestDelta("r1", [tok])], {}))

    steps(1000)
    out = await first
    assert renders == 1 and len(out.outputs[0].token_ids) == 1000 and out.outputs[0].text == "a" * 1000
    # the reader stops: 20,000 more steps cost the request's own growth, no copy per step
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        steps(20_000)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert renders == 1
    assert grown < 2 << 20, f"{grown} bytes for 20,000 unread steps"  # one copy per step would be ~1.7 GB
    llm._on_message((core.OUT, [RequestDelta("r1", [tok], finished=True, finish_reason="length")], {}))
    last = await gen.__anext__()  # everything since the last read, merged in one output
    assert last.finished and len(last.outputs[0].token_ids) == 21_001 and renders == 2
    with pytest.raises(StopAsyncIteration):
        await gen.__anext__()
    assert not any(m[0] == core.ABORT for m in sent) and llm.stats()["num_requests"] == 0


async def test_the_core_dying_fails_open_requests_without_leaking_its_exception_text():
    llm, _ = _async_llm_without_a_core()
    gen = llm.generate("hello", SamplingParams(max_tokens=5), "r1")
    pending = asyncio.ensure_future(gen.__anext__())
    await asyncio.sleep(0)
    llm.log_death = False
    llm._on_message((core.DEAD, "engine core failed: RuntimeError: secret at /home/someone/model.py:12"))
    with pytest.raises(EngineDeadError) as e:
        await pending
    assert "secret" not in str(e.value) and "secret" not in llm.dead_reason
    assert "secret" in llm.death_detail and llm.failed_on_death == 1
    await llm.wait_dead()
    async with _client(llm) as c:
        for r in (await c.get("/health"), await c.post(C, json={"prompt": "a"}),
                  await c.post(CHAT, json={"messages": U, "stream": True})):
            assert r.status_code == 503 and "secret" not in r.text, r.text


async def test_merged_prompts_stop_pulling_when_the_reader_stops():
    pulled = [0, 0, 0]

    async def gen(k: int):
        while True:
            pulled[k] += 1
            yield k

    merged = _merge([gen(k) for k in range(3)])
    await merged.__anext__()
    for _ in range(100):
        await asyncio.sleep(0)
    assert sum(pulled) <= 2 * 3 + 1, pulled  # one queued and one held per prompt, one read
    await merged.aclose()


# -- hostile JSON ---------------------------------------------------------------------------------------------
HOSTILE = [
    '{"prompt": "hi", "max_tokens": ' + "9" * 5000 + "}",
    '{"prompt": "hi", "seed": -' + "1" * 5000 + "}",
    '{"prompt": "hi", "temperature": NaN}',
    '{"prompt": "hi", "top_p": Infinity}',
    '{"prompt": "hi", "x": ' + "[" * 200_000 + "]" * 200_000 + "}",
    '{"prompt": "hi", "stop": ' + "[" * 100 + "]" * 100 + "}",
    '{"prompt": "hi", "x": ' + '{"a": ' * 100 + "1" + "}" * 100 + "}",
    '{"prompt": ' + "[" * 2000 + "1" + "]" * 2000 + "}",
]


@pytest.mark.parametrize("route", [C, "/tokenize"])
@pytest.mark.parametrize("body", HOSTILE, ids=range(len(HOSTILE)))
async def test_huge_integers_nan_and_deep_nesting_are_400s(route, body, caplog):
    eng = FakeAsyncLLM()
    async with _client(eng) as c:
        r = await c.post(route, content=body.encode(), headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text[:300]
        assert len(r.text) < 1000
        assert (await c.post(C, json={"prompt": "hi", "max_tokens": 1})).status_code == 200
    assert "Traceback" not in caplog.text and eng.requests[:-1] == []


@pytest.mark.parametrize("field,value", [
    ("repetition_penalty", 1e-50),  # 0.0 in float32
    ("repetition_penalty", 1e-40),  # a float32 subnormal: logits / it overflow
    ("repetition_penalty", 1e300),
    ("temperature", 1e39),  # inf in float32
    ("temperature", 1e300),
    ("top_p", 1e-50),
    ("temperature", "1e999"),  # JSON 1e999 is inf
])
async def test_floats_are_checked_in_float32(field, value):
    eng = FakeAsyncLLM()
    async with _client(eng) as c:
        body = f'{{"prompt": "hi", "{field}": {value}}}'.encode()
        _bad(await c.post(C, content=body, headers={"content-type": "application/json"}), field)
        if isinstance(value, str):
            return
        _bad(await c.post(CHAT, json={"messages": U, field: value, "stream": True}), field)
        r = await c.post(C, json={"prompt": "hi", "max_tokens": 2, "repetition_penalty": 1.3,
                                  "temperature": 0.7, "top_p": 0.9})
        assert r.status_code == 200
    assert len(eng.requests) == 1


# -- caps -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra,param", [
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"stop": "y" * (MAX_STOP_STRING_CHARS + 1)}, "stop"),
    ({"stop": ["ok", "z" * 100_000]}, "stop"),
    ({"stop_token_ids": [7] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
    ({"stop_token_ids": list(range(200_000))}, "stop_token_ids"),
])
async def test_stop_strings_and_ids_are_capped(extra, param):
    async with _client(FakeAsyncLLM()) as c:
        err = _bad(await c.post(C, json={"prompt": "hi"} | extra), param)
        assert len(err["message"]) < 200
        ok = {"stop": ["x"] * MAX_STOP_STRINGS, "stop_token_ids": [7] * MAX_STOP_TOKEN_IDS, "max_tokens": 2}
        assert (await c.post(C, json={"prompt": "hi"} | ok)).status_code == 200


async def test_prompts_per_request_are_capped():
    eng = FakeAsyncLLM()
    async with _client(eng, max_prompts_per_request=3) as c:
        err = _bad(await c.post(C, json={"prompt": ["a"] * 4}), "prompt")
        assert "at most 3" in err["message"]
        _bad(await c.post(C, json={"prompt": [[5]] * 4}), "prompt")
        assert eng.requests == []
        r = await c.post(C, json={"prompt": ["a", "b", "c"], "max_tokens": 1})
        assert r.status_code == 200 and len(r.json()["choices"]) == 3
        r = await c.post(C, json={"prompt": [5] * 100, "max_tokens": 1})  # one prompt of 100 token ids
        assert r.status_code == 200 and len(r.json()["choices"]) == 1
    assert ServerConfig().max_prompts_per_request >= 64


# -- admission before tokenising, tokenising off the loop ---------------------------------------------------
async def test_admission_comes_before_tokenising():
    eng = FakeAsyncLLM()
    eng.gate = asyncio.Event()
    calls = []
    encode, template = eng.tokenizer.encode, eng.tokenizer.apply_chat_template
    eng.tokenizer.encode = lambda *a, **k: calls.append("encode") or encode(*a, **k)
    eng.tokenizer.apply_chat_template = lambda *a, **k: calls.append("template") or template(*a, **k)
    async with _client(eng, max_waiting_requests=2) as c:
        queued = [asyncio.ensure_future(c.post(C, json={"prompt": "a", "max_tokens": 1})) for _ in range(2)]
        await _until(lambda: len(eng.waiting) == 2)
        calls.clear()
        for route, body in ((C, {"prompt": ["x" * 1000] * 3}), (CHAT, {"messages": U})):
            r = await c.post(route, json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy"
        assert calls == []  # refused before a single token was made
        eng.gate.set()
        assert [r.status_code for r in await asyncio.gather(*queued)] == [200, 200]


async def test_a_slow_tokenizer_does_not_freeze_the_event_loop():
    eng = FakeAsyncLLM()
    encode = eng.tokenizer.encode

    def slow(text, add_special_tokens=True):
        time.sleep(0.8)  # megabytes of prompt
        return encode(text, add_special_tokens)

    eng.tokenizer.encode = slow
    gc.collect()  # so that no full pass over earlier tests' objects (0.7 s in a suite) lands in the timing
    async with _client(eng) as c:
        big = [asyncio.ensure_future(c.post(C, json={"prompt": "x", "max_tokens": 1})),
               asyncio.ensure_future(c.post("/tokenize", json={"prompt": "x"}))]
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        assert (await c.get("/health")).status_code == 200
        assert (await c.post(C, json={"prompt": [5, 6], "max_tokens": 1})).status_code == 200
        assert time.monotonic() - t0 < 0.4
        assert [r.status_code for r in await asyncio.gather(*big)] == [200, 200]


# -- unknown fields -------------------------------------------------------------------------------------------
async def test_unknown_fields_are_named_in_the_answer_escaped_and_not_remembered(caplog):
    caplog.set_level(logging.INFO)
    eng = FakeAsyncLLM()
    async with _client(eng, api_key="k") as c:  # /tokenize needs no key
        r = await c.post("/tokenize", json={"prompt": "a", "evil\nINFO forged": 1, "b" * 10_000: 2})
        assert r.status_code == 200
        named = r.headers[IGNORED_FIELDS_HEADER]
        assert "'evil\\nINFO forged'" in named and len(named) < 200
        assert not any("\n" in rec.getMessage() for rec in caplog.records)
        assert "forged" in caplog.text  # logged, escaped
        for i in range(100):  # new names every time: named in each answer, one log line for all
            r = await c.post("/tokenize", json={"prompt": "a", f"f{i}": 1})
            assert r.headers[IGNORED_FIELDS_HEADER] == f"'f{i}'"
        key = {"Authorization": "Bearer k"}
        r = await c.post(C, json={"prompt": "a", "max_tokens": 1, "zz": 1}, headers=key)
        assert r.headers[IGNORED_FIELDS_HEADER] == "'zz'"
        r = await c.post(CHAT, json={"messages": U, "max_tokens": 1, "stream": True, "zz": 1}, headers=key)
        assert r.headers[IGNORED_FIELDS_HEADER] == "'zz'"
        many = {f"u{i}": 1 for i in range(50)}
        r = await c.post("/tokenize", json={"prompt": "a"} | many)
        assert r.headers[IGNORED_FIELDS_HEADER].endswith("+34 more")
        assert IGNORED_FIELDS_HEADER not in (await c.post("/tokenize", json={"prompt": "a"})).headers
    lines = [rec for rec in caplog.records if "unknown request fields" in rec.getMessage()]
    assert len(lines) == 1


# -- serve: a dead core stops the server; the connection limit; the loopback warning --------------------------
async def test_serve_exits_1_with_one_line_when_the_core_dies_and_limits_connections(monkeypatch, caplog):
    eng = FakeAsyncLLM(delay=0.01, max_model_len=4096)

    async def start(config):
        return eng

    monkeypatch.setattr(AsyncLLM, "start", start)
    froze = []  # the start-up heap is frozen once the engine is up (this test process's own heap is not)
    monkeypatch.setattr(frozen_heap, "freeze_heap", lambda: froze.append(eng.ready))
    sock = api_server.bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    served = asyncio.ensure_future(api_server.serve(None, ServerConfig(max_connections=3, access_log=False), sock))
    events: list[list[str]] = [[], [], []]

    async def stream(k: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            async with c.stream("POST", C, json={"prompt": "a", "max_tokens": 2000, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events[k].append(line[6:])

    async with httpx.AsyncClient(base_url=url, timeout=10, limits=httpx.Limits(max_keepalive_connections=0)) as c:
        await _until(lambda: served.done() or eng.ready)
        streams = []
        for k in range(3):
            streams.append(asyncio.ensure_future(stream(k)))
            await _until(lambda: events[k] or streams[k].done() or served.done())
        assert events[0] and events[1] and streams[2].done() and not events[2]
        assert len(eng.open) == 2  # the third request found three connections open: uvicorn's 503
        assert froze == [True]
        caplog.clear()
        eng.die("the engine core failed", "engine core failed: the detail only the log shows")
        assert await asyncio.wait_for(served, 20) == 1
    await asyncio.gather(*streams)
    for ev in filter(None, events):
        assert ev[-1] == "[DONE]" and '"engine_dead"' in ev[-2] and "detail only the log" not in ev[-2]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "engine core died" in errors[0].getMessage(), errors
    assert "detail only the log shows" in errors[0].getMessage()
    assert "2 open requests failed" in errors[0].getMessage()


def test_warning_when_listening_beyond_the_loopback_without_a_key(caplog):
    for host, key, warns in (("0.0.0.0", None, True), ("127.0.0.1", None, False), ("0.0.0.0", "k", False)):
        sock = api_server.bind(host, 0)
        try:
            assert api_server.warn_if_open(ServerConfig(host=host, api_key=key), sock) is warns
        finally:
            sock.close()
    assert "without --api-key" in caplog.text
    assert api_server.is_loopback("::1") and api_server.is_loopback("127.0.0.2")
    assert not api_server.is_loopback("::") and not api_server.is_loopback("10.0.0.1")


def test_logprobs_json_never_carries_inf_or_nan():
    from tdpipe.entrypoints.openai.logprobs import MIN_LOGPROB, chat_logprobs, completion_logprobs
    from tdpipe.outputs import Logprob

    tok = FakeTokenizer()
    pos = [{70: Logprob(float("-inf"), 1, "a"), 71: Logprob(float("nan"), 2, "b")}]
    c = completion_logprobs(tok, [70], pos, 2)
    assert c["token_logprobs"] == [MIN_LOGPROB] and list(c["top_logprobs"][0].values()) == [MIN_LOGPROB] * 2
    ch = chat_logprobs(tok, [70], pos, 2)["content"][0]
    assert ch["logprob"] == MIN_LOGPROB and [t["logprob"] for t in ch["top_logprobs"]] == [MIN_LOGPROB] * 2


async def test_a_stalled_stream_holds_the_engine_back_and_frees_everything_when_it_hangs_up():
    import socket

    import uvicorn

    eng = FakeAsyncLLM(max_model_len=1 << 20)
    app = build_app(eng, ServerConfig(access_log=False))
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning"))
    listen = api_server.bind("127.0.0.1", 0)
    served = asyncio.ensure_future(server.serve(sockets=[listen]))
    body = b'{"prompt": "a", "max_tokens": 1000000, "stream": true}'
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        await _until(lambda: server.started)
        s.connect(listen.getsockname())
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await _until(lambda: eng.generation_tokens > 100)
        while True:  # the client reads nothing: the buffers fill, then the engine is not asked for more
            seen = eng.generation_tokens
            await asyncio.sleep(0.3)
            if eng.generation_tokens == seen:
                break
        assert seen < 200_000 and app.state.serving.admission.open == 1
        s.close()  # hangs up: the request is aborted, its place in the queue given back
        await _until(lambda: not eng.open and app.state.serving.admission.open == 0)
        assert eng.aborted
    finally:
        s.close()
        server.should_exit = True
        await served


async def test_a_body_that_stops_arriving_gets_408(monkeypatch):
    import socket

    import uvicorn

    monkeypatch.setattr(api_server, "BODY_READ_TIMEOUT_S", 0.3)
    eng = FakeAsyncLLM()
    server = uvicorn.Server(uvicorn.Config(build_app(eng, ServerConfig()), lifespan="off", log_level="warning"))
    listen = api_server.bind("127.0.0.1", 0)
    served = asyncio.ensure_future(server.serve(sockets=[listen]))
    s = socket.socket()
    s.setblocking(False)
    try:
        await _until(lambda: server.started)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(s, listen.getsockname())
        await loop.sock_sendall(s, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                                   b"\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
        answer = await asyncio.wait_for(loop.sock_recv(s, 4096), 10)
        assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
        assert eng.requests == []
    finally:
        s.close()
        server.should_exit = True
        await served


async def test_a_chat_of_100k_messages_never_freezes_the_event_loop():
    """/health answers all along, and the request leaves the garbage collector's full passes asleep: they
    hold the interpreter lock, so one over a test process's heap stopped the event loop for 1.5 s in CI when
    the 100,000 messages were kept as models (and the depth check queued a tuple per message)."""
    import json

    eng = FakeAsyncLLM(max_model_len=1 << 24)
    body = json.dumps({"messages": [{"role": "user", "content": "a"}] * 100_000, "max_tokens": 1}).encode()
    full_passes = []

    def watch(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            full_passes.append(time.monotonic())

    gc.collect()  # what earlier tests left is not this request's doing
    gc.callbacks.append(watch)
    try:
        async with _client(eng) as c:
            t0 = time.monotonic()
            big = asyncio.ensure_future(c.post(CHAT, content=body,
                                               headers={"content-type": "application/json"}))
            gaps = []
            while not big.done():
                t = time.monotonic()
                assert (await c.get("/health")).status_code == 200
                gaps.append(time.monotonic() - t)
                await asyncio.sleep(0.005)
            total = time.monotonic() - t0
            assert (await big).status_code == 200
    finally:
        gc.callbacks.remove(watch)
    print(f"longest /health wait {max(gaps):.3f} s of {total:.2f} s, {len(gaps)} answered")
    assert len(gaps) > 5 and max(gaps) < total / 3, (max(gaps), total, len(gaps))
    assert full_passes == [], f"{len(full_passes)} full garbage collections during the request"


@contextlib.asynccontextmanager
async def _raw_connection(config: ServerConfig):
    """uvicorn serving a fake engine with `serve`'s settings for `config`, and one raw non-blocking socket
    connected to it: yields (socket, loop, uvicorn config, port); stops the server after."""
    import socket

    import uvicorn

    cfg = api_server.uvicorn_config(build_app(FakeAsyncLLM(), ServerConfig()), config)
    cfg.log_level = "warning"
    server = uvicorn.Server(cfg)
    listen = api_server.bind("127.0.0.1", 0)
    served = asyncio.ensure_future(server.serve(sockets=[listen]))
    s = socket.socket()
    s.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        await _until(lambda: server.started)
        await loop.sock_connect(s, listen.getsockname())
        yield s, loop, cfg, listen.getsockname()[1]
    finally:
        s.close()
        server.should_exit = True
        await served


async def test_a_connection_that_sends_nothing_is_closed(monkeypatch):
    monkeypatch.setattr(api_server, "FIRST_REQUEST_TIMEOUT_S", 0.3)
    async with _raw_connection(ServerConfig(max_connections=7)) as (s, loop, cfg, port):
        assert cfg.limit_concurrency == 7
        t0 = time.monotonic()
        assert await asyncio.wait_for(loop.sock_recv(s, 100), 10) == b""  # closed by the server
        assert time.monotonic() - t0 < 5
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
            assert (await c.get("/health")).status_code == 200  # requests are unaffected


def test_idle_keep_alive_outlives_the_clients_pools():
    """A server that closes an idle connection when the client's pool would still reuse it races it: the
    client's next request goes out as the FIN arrives and fails with a connection error (uvicorn and httpx,
    so the openai client, both default to 5 s). The server keeps idle connections longer than httpx's and
    aiohttp's (15 s) pools do."""
    assert ServerConfig().timeout_keep_alive_s > max(httpx.Limits().keepalive_expiry or 0, 15.0)
    cfg = api_server.uvicorn_config(build_app(FakeAsyncLLM(), ServerConfig()),
                                    ServerConfig(timeout_keep_alive_s=45))
    assert cfg.timeout_keep_alive == 45
    with pytest.raises(ValueError, match="timeout_keep_alive_s"):
        ServerConfig(timeout_keep_alive_s=0)


async def test_an_idle_connection_is_closed_after_the_keep_alive_timeout_not_before():
    async with _raw_connection(ServerConfig(timeout_keep_alive_s=1.5)) as (s, loop, _, _):
        await loop.sock_sendall(s, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(loop.sock_recv(s, 4096), 10)).startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):  # still open while idle for less than the timeout
            await asyncio.wait_for(loop.sock_recv(s, 100), 0.5)
        assert await asyncio.wait_for(loop.sock_recv(s, 100), 10) == b""  # then closed by the server
        assert time.monotonic() - t0 < 4.5  # not uvicorn's 5 s default


async def test_async_llm_behind_uvicorn_a_stalled_stream_costs_one_slot_and_gives_its_place_back():
    """The whole chain with AsyncLLM's real output path (the core's messages fed by hand): a client that
    stops reading stalls its stream, later steps only mark its slot, and its place in the queue comes back
    when the request finishes, before the client reads the end."""
    import socket

    import uvicorn

    llm, sent = _async_llm_without_a_core()
    renders = 0
    render = llm.processor.render

    def counting(st):
        nonlocal renders
        renders += 1
        return render(st)

    llm.processor.render = counting
    app = build_app(llm, ServerConfig())
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning"))
    listen = api_server.bind("127.0.0.1", 0)
    served = asyncio.ensure_future(server.serve(sockets=[listen]))
    body = b'{"prompt": "a", "max_tokens": 500000, "stream": true}'
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    tok = OFFSET + ord("a")
    try:
        await _until(lambda: server.started)
        s.connect(listen.getsockname())
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await _until(lambda: any(m[0] == core.ADD for m in sent))
        rid = next(m[1] for m in sent if m[0] == core.ADD)

        async def steps(k: int) -> None:
            for _ in range(k):
                llm._on_message((core.OUT, [RequestDelta(rid, [tok])], {}))
                await asyncio.sleep(0)

        while True:  # until the client's buffers are full and the stream stops reading its slot
            before = renders
            await steps(2000)
            if renders - before <= 1:
                break
        stalled = renders
        await steps(20_000)
        assert renders - stalled <= 1  # 20,000 steps, at most one output built for the stalled reader
        adm = app.state.serving.admission
        assert adm.open == 1 and llm.stats()["num_unfinished"] == 1
        llm._on_message((core.OUT, [RequestDelta(rid, [tok], finished=True, finish_reason="length")], {}))
        # finished in the engine: it no longer counts as waiting, though the client still reads nothing
        assert llm.stats()["num_unfinished"] == 0 and adm.waiting(llm) == 0
        s.close()  # hangs up: its ticket and slot are given back
        await _until(lambda: not llm._collectors and adm.open == 0)
    finally:
        s.close()
        server.should_exit = True
        await served
