"""The OpenAI routes against a fake engine (tests/fake_engine_client.py): response shapes, SSE streams,
usage counts, batches, health and metrics, admission control, and what happens when a client hangs up or
the engine dies. Fast: no model, no processes."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fake_engine_client import EOS, FakeAsyncLLM
from tdpipe.entrypoints.openai.api_server import ServerConfig, build_app, set_engine

pytestmark = pytest.mark.anyio

C, CHAT = "/v1/completions", "/v1/chat/completions"
U = [{"role": "user", "content": "hi"}]



def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def _until(cond, timeout: float = 10.0) -> None:
    """Poll `cond` until it holds; fail (not hang) if it does not within `timeout` seconds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.002)


def _app(engine, **cfg):
    return build_app(engine, ServerConfig(**cfg))


def _events(r: httpx.Response) -> list:
    """The SSE stream as a list of JSON objects, with the final "[DONE]" kept as a string."""
    assert r.headers["content-type"].startswith("text/event-stream")
    out = []
    for block in r.text.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_completion_shape_and_exact_usage():
    eng = FakeAsyncLLM()
    async with _client(_app(eng)) as c:
        r = await c.post(C, json={"prompt": "hello", "max_tokens": 7, "temperature": 0, "user": "u1"})
    assert r.status_code == 200
    b = r.json()
    assert b["id"].startswith("cmpl-") and b["object"] == "text_completion" and b["model"] == "fake-model"
    assert isinstance(b["created"], int)
    (ch,) = b["choices"]
    assert ch["index"] == 0 and ch["finish_reason"] == "length" and ch["logprobs"] is None
    ids, params, rid = eng.requests[0]
    assert ids == eng.tokenizer.encode("hello") and params.max_tokens == 7 and params.temperature == 0
    assert rid == b["id"]
    assert b["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 7, "total_tokens": len(ids) + 7}
    assert len(ch["text"]) == 7
    # vLLM's --enable-prompt-tokens-details adds OpenAI's cached-token count (the fake engine caches nothing)
    async with _client(_app(FakeAsyncLLM(), enable_prompt_tokens_details=True)) as c:
        r = await c.post(C, json={"prompt": "hello", "max_tokens": 2})
        chat = await c.post(CHAT, json={"messages": U, "max_tokens": 2, "stream": True,
                                        "stream_options": {"include_usage": True}})
    assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert _events(chat)[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # [-1]: [DONE]


async def test_stop_strings_eos_and_stop_token_ids():
    eng = FakeAsyncLLM()
    async with _client(_app(eng)) as c:
        base = {"prompt": "hello", "max_tokens": 7, "temperature": 0}
        full = (await c.post(C, json=base)).json()["choices"][0]["text"]
        stop = full[3]
        r = (await c.post(C, json=base | {"stop": [stop, "zzz"]})).json()
        assert r["choices"][0] | {"text": r["choices"][0]["text"]} == {
            "index": 0, "text": full[:3], "logprobs": None, "finish_reason": "stop", "stop_reason": stop}
        r = (await c.post(C, json=base | {"stop": stop, "include_stop_str_in_output": True})).json()
        assert r["choices"][0]["text"] == full[:4]
        r = (await c.post(C, json={"prompt": "x [eos]", "max_tokens": 10, "temperature": 0})).json()
        assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["stop_reason"] is None
        assert r["usage"]["completion_tokens"] == 4
        r = (await c.post(C, json={"prompt": "x [eos]", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                   "skip_special_tokens": False})).json()
        assert r["choices"][0]["finish_reason"] == "length" and "</s>" in r["choices"][0]["text"]
        tok = eng.tokenizer.encode(full[1], add_special_tokens=False)[0]
        r = (await c.post(C, json=base | {"stop_token_ids": [tok]})).json()
        assert r["choices"][0]["stop_reason"] == tok and r["choices"][0]["finish_reason"] == "stop"
    assert EOS == eng.tokenizer.eos_token_id


async def test_streaming_completion_matches_the_full_answer_and_reports_usage():
    eng = FakeAsyncLLM()
    body = {"prompt": "hello there", "max_tokens": 9, "temperature": 0}
    async with _client(_app(eng)) as c:
        full = (await c.post(C, json=body)).json()
        ev = _events(await c.post(C, json=body | {"stream": True, "stream_options": {"include_usage": True}}))
    assert ev[-1] == "[DONE]"
    usage_chunk, chunks = ev[-2], ev[:-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == full["usage"]
    assert all(x["object"] == "text_completion" and x["id"] == chunks[0]["id"] for x in chunks)
    assert all(x["usage"] is None for x in chunks)
    assert "".join(x["choices"][0]["text"] for x in chunks) == full["choices"][0]["text"]
    assert [x["choices"][0]["finish_reason"] for x in chunks] == [None] * (len(chunks) - 1) + ["length"]
    ev = _events(await _client(_app(eng)).post(C, json=body | {"stream": True}))
    assert all("choices" in x and x["choices"] for x in ev[:-1])  # no usage chunk unless asked


async def test_streaming_chat_role_first_then_deltas():
    eng = FakeAsyncLLM()
    body = {"messages": U, "max_completion_tokens": 6, "temperature": 0}
    async with _client(_app(eng)) as c:
        full = (await c.post(CHAT, json=body)).json()
        ev = _events(await c.post(CHAT, json=body | {"stream": True,
                                                      "stream_options": {"include_usage": True}}))
    assert full["object"] == "chat.completion" and full["id"].startswith("chatcmpl-")
    assert full["choices"][0]["message"]["role"] == "assistant"
    prompt = eng.tokenizer.encode(eng.tokenizer.apply_chat_template(U), add_special_tokens=False)
    assert eng.requests[0][0] == prompt
    assert full["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 6,
                             "total_tokens": len(prompt) + 6}
    chunks = ev[:-2]
    assert all(x["object"] == "chat.completion.chunk" for x in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(x["choices"][0]["delta"].get("content", "") for x in chunks)
    assert text == full["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert ev[-2]["usage"] == full["usage"] and ev[-1] == "[DONE]"


async def test_chat_defaults_to_the_room_left_and_text_parts_join():
    eng = FakeAsyncLLM(max_model_len=64)
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    async with _client(_app(eng)) as c:
        r = (await c.post(CHAT, json={"messages": msgs, "temperature": 0})).json()
    ids = eng.requests[0][0]
    assert eng.tokenizer.decode(ids).endswith("<|user|>ab\n<|assistant|>")
    assert r["usage"]["completion_tokens"] == 64 - len(ids) and r["choices"][0]["finish_reason"] == "length"


async def test_batch_of_prompts_is_one_choice_each():
    eng = FakeAsyncLLM()
    async with _client(_app(eng)) as c:
        r = (await c.post(C, json={"prompt": ["ab", "cde"], "max_tokens": 3, "temperature": 0})).json()
        ev = _events(await c.post(C, json={"prompt": [[5, 6, 7], [8]], "max_tokens": 2, "stream": True}))
        one = (await c.post(C, json={"prompt": [5, 6, 7], "max_tokens": 2})).json()
    assert [ch["index"] for ch in r["choices"]] == [0, 1]
    assert r["usage"]["prompt_tokens"] == 3 + 4 and r["usage"]["completion_tokens"] == 6
    rids = [rid for _, _, rid in eng.requests]
    assert rids[0] == r["id"] + "-0" and rids[1] == r["id"] + "-1"
    assert {ch["index"] for x in ev[:-1] for ch in x["choices"]} == {0, 1}
    assert sum(1 for x in ev[:-1] if x["choices"][0]["finish_reason"]) == 2
    assert eng.requests[2][0] == [5, 6, 7] and eng.requests[3][0] == [8]
    assert one["usage"]["prompt_tokens"] == 3


async def test_echo_prepends_the_prompt():
    async with _client(_app(FakeAsyncLLM())) as c:
        r = (await c.post(C, json={"prompt": "hey", "max_tokens": 2, "echo": True})).json()
        ev = _events(await c.post(C, json={"prompt": "hey", "max_tokens": 2, "echo": True, "stream": True}))
    assert r["choices"][0]["text"].startswith("hey") and len(r["choices"][0]["text"]) == 5
    assert ev[0]["choices"][0]["text"] == "hey"


async def test_seeds_make_sampling_reproducible():
    async with _client(_app(FakeAsyncLLM())) as c:
        body = {"prompt": "hi", "max_tokens": 20, "temperature": 1.0}
        a, b, d = [(await c.post(C, json=body | {"seed": s})).json()["choices"][0]["text"] for s in (7, 7, 8)]
    assert a == b and a != d


async def test_models_health_and_served_name():
    eng = FakeAsyncLLM(max_model_len=99)
    async with _client(_app(eng, served_model_name="mine")) as c:
        m = (await c.get("/v1/models")).json()
        assert m["object"] == "list" and [x["id"] for x in m["data"]] == ["mine"]
        assert m["data"][0]["max_model_len"] == 99 and m["data"][0]["root"] == "fake-model"
        assert (await c.get("/v1/models/mine")).json()["id"] == "mine"
        assert (await c.get("/v1/models/fake-model")).status_code == 404
        assert (await c.post(C, json={"prompt": "a", "model": "fake-model"})).status_code == 404
        r = await c.post(C, json={"prompt": "a", "model": "mine", "max_tokens": 1})
        assert r.json()["model"] == "mine"
        assert (await c.get("/health")).json() == {"status": "ok"}
        from tdpipe.version import package_version

        assert (await c.get("/version")).json() == {"version": package_version()}  # vLLM's route


async def test_503_while_starting_then_serves():
    app = _app(None)
    async with _client(app) as c:
        r = await c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "starting"
        for resp in (await c.post(C, json={"prompt": "a"}), await c.get("/v1/models")):
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_starting"
            assert resp.headers["retry-after"]
        text = (await c.get("/metrics")).text
        assert "tdpipe:engine_ready 0.0" in text
        set_engine(app, FakeAsyncLLM())
        assert (await c.get("/health")).status_code == 200
        assert (await c.post(C, json={"prompt": "a", "max_tokens": 1})).status_code == 200


async def test_dead_engine_503_and_stream_error_chunk():
    eng = FakeAsyncLLM(delay=0.01)
    async with _client(_app(eng)) as c:
        async def stream():
            return await c.post(C, json={"prompt": "a", "max_tokens": 50, "stream": True})

        async def plain():
            return await c.post(C, json={"prompt": "b", "max_tokens": 50})

        ts, tp = asyncio.ensure_future(stream()), asyncio.ensure_future(plain())
        await _until(lambda: eng.generation_tokens >= 6)
        eng.die("engine core process exited with signal 9")
        rs, rp = await ts, await tp
        ev = _events(rs)
        assert ev[-1] == "[DONE]" and ev[-2]["error"]["code"] == "engine_dead"
        assert "signal 9" in ev[-2]["error"]["message"] and ev[0]["choices"][0]["text"]
        assert rp.status_code == 503 and rp.json()["error"]["code"] == "engine_dead"
        h = await c.get("/health")
        assert h.status_code == 503 and h.json() == {"status": "dead",
                                                     "reason": "engine core process exited with signal 9"}
        r = await c.post(CHAT, json={"messages": U})
        assert r.status_code == 503 and "signal 9" in r.json()["error"]["message"]
    assert eng.open == set()


async def test_engine_refusal_is_a_400():
    class Refusing(FakeAsyncLLM):
        async def generate(self, prompt, params=None, request_id=None):
            raise ValueError("prompt token ids must be integers in [0, 200)")
            yield  # an async generator, like the real one

    async with _client(_app(Refusing())) as c:
        r = await c.post(C, json={"prompt": [250], "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        ev = _events(await c.post(C, json={"prompt": [250], "max_tokens": 2, "stream": True}))
        assert ev[0]["error"]["param"] == "prompt" and ev[-1] == "[DONE]"


async def test_metrics_parse_and_count():
    eng = FakeAsyncLLM()
    async with _client(_app(eng)) as c:
        for _ in range(3):
            await c.post(C, json={"prompt": "abc", "max_tokens": 4})
        text = (await c.get("/metrics")).text
        assert (await c.get("/metrics")).headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("tdpipe:num_requests_running", "tdpipe:num_requests_waiting", "tdpipe:kv_cache_usage_perc",
                 "tdpipe:prompt_tokens", "tdpipe:generation_tokens", "tdpipe:num_preemptions",
                 "tdpipe:time_to_first_token_seconds", "tdpipe:time_per_output_token_seconds",
                 "tdpipe:e2e_request_latency_seconds", "tdpipe:stage_busy_ratio"):
        assert name in fams, name
    value = {s.name: s.value for f in fams.values() for s in f.samples if not s.labels}
    assert value["tdpipe:generation_tokens_total"] == 12 and value["tdpipe:prompt_tokens_total"] == 12
    assert value["tdpipe:time_to_first_token_seconds_count"] == 3
    assert value["tdpipe:time_per_output_token_seconds_count"] == 3
    assert value["tdpipe:e2e_request_latency_seconds_count"] == 3
    busy = {s.labels["stage"]: s.value for s in fams["tdpipe:stage_busy_ratio"].samples}
    assert busy == {"0": 0.75, "1": 0.5}
    # every app has its own registry: a second app starts from zero
    async with _client(_app(FakeAsyncLLM())) as c:
        text2 = (await c.get("/metrics")).text
    assert "tdpipe:time_to_first_token_seconds_count 0.0" in text2


async def test_tokenize_and_detokenize():
    eng = FakeAsyncLLM()
    async with _client(_app(eng)) as c:
        t = (await c.post("/tokenize", json={"prompt": "ab"})).json()
        assert t == {"tokens": eng.tokenizer.encode("ab"), "count": 3, "max_model_len": 128}
        t = (await c.post("/tokenize", json={"prompt": "ab", "add_special_tokens": False})).json()
        assert t["count"] == 2
        t = (await c.post("/tokenize", json={"messages": U})).json()
        tok = eng.tokenizer
        assert t["tokens"] == tok.encode(tok.apply_chat_template(U), add_special_tokens=False)
        d = await c.post("/detokenize", json={"tokens": tok.encode("ab", add_special_tokens=False)})
        assert d.json() == {"prompt": "ab"}


async def test_full_queue_gets_503_with_retry_after():
    eng = FakeAsyncLLM()
    eng.gate = asyncio.Event()
    async with _client(_app(eng, max_waiting_requests=2)) as c:
        held = [asyncio.ensure_future(c.post(C, json={"prompt": f"p{i}", "max_tokens": 2})) for i in range(2)]
        await _until(lambda: len(eng.waiting) == 2)
        r = await c.post(C, json={"prompt": "late", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "server_busy"
        r = await c.post(C, json={"prompt": ["a", "b", "c"], "max_tokens": 2})
        assert r.status_code == 503
        eng.gate.set()
        assert [x.status_code for x in await asyncio.gather(*held)] == [200, 200]
        assert (await c.post(C, json={"prompt": "now", "max_tokens": 2})).status_code == 200


async def test_admission_counts_return_to_zero():
    eng = FakeAsyncLLM()
    app = _app(eng, max_waiting_requests=3)
    async with _client(app) as c:
        await asyncio.gather(*(c.post(C, json={"prompt": "x", "max_tokens": 3, "stream": s})
                               for s in (False, True) * 3))
        await c.post(C, json={"prompt": "x", "n": 5})
    adm = app.state.serving.admission
    assert (adm.open, adm.unstarted) == (0, 0)


# -- clients that hang up: driven through the ASGI interface, where a disconnect is exact ----------------
async def _call(app, path: str, body: dict, hang_up: asyncio.Event, sent: list) -> None:
    got_body = False

    async def receive():
        nonlocal got_body
        if not got_body:
            got_body = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await hang_up.wait()
        return {"type": "http.disconnect"}

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
             "client": ("127.0.0.1", 5000), "server": ("test", 80)}
    await app(scope, receive, send)


async def test_hang_up_mid_stream_aborts_the_request():
    eng = FakeAsyncLLM(max_model_len=4096, delay=0.005)
    app = _app(eng)
    hang_up, sent = asyncio.Event(), []
    task = asyncio.ensure_future(_call(app, C, {"prompt": "a", "max_tokens": 1000, "stream": True,
                                                "ignore_eos": True}, hang_up, sent))
    await _until(lambda: sum(1 for m in sent if m.get("body")) >= 3)
    hang_up.set()
    await asyncio.wait_for(task, 10)
    rid = eng.requests[0][2]
    assert eng.aborted == [rid] and eng.open == set() and eng.used_blocks == {}
    assert eng.generation_tokens < 1000
    adm = app.state.serving.admission
    assert (adm.open, adm.unstarted) == (0, 0)


@pytest.mark.parametrize("stream", [False, True])
async def test_hang_up_while_queued_aborts_the_request(stream):
    eng = FakeAsyncLLM()
    eng.gate = asyncio.Event()  # never opened: the request waits in the queue
    app = _app(eng)
    hang_up, sent = asyncio.Event(), []
    body = {"prompt": "a", "max_tokens": 5, "stream": stream}
    task = asyncio.ensure_future(_call(app, C, body, hang_up, sent))
    await _until(lambda: bool(eng.waiting))
    hang_up.set()
    await asyncio.wait_for(task, 10)
    assert eng.aborted == [eng.requests[0][2]] and eng.open == set() and eng.waiting == set()
    adm = app.state.serving.admission
    assert (adm.open, adm.unstarted) == (0, 0)


async def test_bad_requests_do_not_disturb_one_in_flight():
    eng = FakeAsyncLLM(delay=0.002)
    async with _client(_app(eng)) as c:
        good = asyncio.ensure_future(c.post(C, json={"prompt": "ok", "max_tokens": 40, "temperature": 0,
                                                     "stream": True}))
        bad = [c.post(C, json={"prompt": "ok", "temperature": -1}), c.post(C, content=b"{nope"),
               c.post(CHAT, json={"messages": [{"role": "x", "content": "y"}]})]
        assert [r.status_code for r in await asyncio.gather(*bad)] == [400, 400, 400]
        ev = _events(await good)
    assert ev[-2]["choices"][0]["finish_reason"] == "length"
    assert sum(len(x["choices"][0]["text"]) for x in ev[:-1]) == 40


async def test_return_token_ids_only_when_asked():
    eng = FakeAsyncLLM()
    body = {"prompt": "hey", "max_tokens": 6, "temperature": 0}
    async with _client(_app(eng)) as c:
        plain = (await c.post(C, json=body)).json()["choices"][0]
        full = (await c.post(C, json=body | {"return_token_ids": True})).json()["choices"][0]
        ev = _events(await c.post(C, json=body | {"return_token_ids": True, "stream": True}))
        chat = (await c.post(CHAT, json={"messages": U, "max_tokens": 3, "return_token_ids": True})).json()
        cev = _events(await c.post(CHAT, json={"messages": U, "max_tokens": 3, "return_token_ids": True,
                                                "stream": True}))
    assert "token_ids" not in plain and "prompt_token_ids" not in plain
    assert full["prompt_token_ids"] == eng.tokenizer.encode("hey") and len(full["token_ids"]) == 6
    assert eng.tokenizer.decode(full["token_ids"]) == full["text"]
    assert [t for x in ev[:-1] for t in x["choices"][0]["token_ids"]] == full["token_ids"]
    assert ev[0]["choices"][0]["prompt_token_ids"] == full["prompt_token_ids"]
    assert "prompt_token_ids" not in ev[1]["choices"][0]
    assert len(chat["choices"][0]["token_ids"]) == 3 and chat["choices"][0]["prompt_token_ids"]
    assert sum(len(x["choices"][0].get("token_ids", [])) for x in cev[:-1]) == 3
