"""The server's bad-input matrix against a fake engine: every invalid request is a 4xx with OpenAI's error
body naming the field, and none of them disturbs the engine (nothing left open, every KV block free, the
next good request answered)."""
from __future__ import annotations

import json

import httpx
import pytest

from fake_engine_client import FakeAsyncLLM
from server_inputs import C, CHAT, MATRIX, U, bad_inputs  # noqa: F401
from tdpipe.entrypoints.openai.api_server import ServerConfig, build_app

pytestmark = pytest.mark.anyio


async def _app(engine: FakeAsyncLLM, **cfg):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine, ServerConfig(**cfg))),
                             base_url="http://test")


def _check_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:  # the message names the field too (its top-level name at least)
        assert param.split("[")[0].split(".")[0] in err["message"], err
    return err


async def test_bad_input_matrix_then_still_serving():
    eng = FakeAsyncLLM(max_model_len=128)
    cases = bad_inputs(eng.max_model_len)
    async with await _app(eng) as c:
        for route, body, status, param in cases:
            r = await c.post(route, json=body)
            _check_error(r, status, param)
        assert len(cases) >= 25
        assert eng.open == set() and eng.used_blocks == {}
        assert eng.stats()["num_free_blocks"] == eng.stats()["num_blocks"]
        assert eng.requests == []  # none of them reached the engine
        r = await c.post(C, json={"prompt": "hi", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


async def test_n_message_names_the_limit():
    async with await _app(FakeAsyncLLM()) as c:
        err = _check_error(await c.post(C, json={"prompt": "hi", "n": 5}), 400, "n")
        assert err["message"] == "n is 5, more samples than this server runs at once (--max-num-seqs 4)"


@pytest.mark.parametrize("content,headers,status,code", [
    (b'{"prompt": "hi", ', {"content-type": "application/json"}, 400, "invalid_json"),
    (b'["prompt"]', {"content-type": "application/json"}, 400, "invalid_json"),
    (b'{"prompt": "\xff\xfe"}', {"content-type": "application/json"}, 400, "invalid_encoding"),
    (b"", {"content-type": "application/json"}, 400, "invalid_json"),
    (b'{"prompt": "hi"}', {"content-type": "text/plain"}, 415, "unsupported_media_type"),
    (b'{"prompt": "hi"}', {"content-type": "application/x-www-form-urlencoded"}, 415,
     "unsupported_media_type"),
    (b'{"prompt": "hi"}', {"content-type": "application/json; charset=latin-1"}, 415,
     "unsupported_media_type"),
])
async def test_malformed_bodies(content, headers, status, code):
    eng = FakeAsyncLLM()
    async with await _app(eng) as c:
        r = await c.post(C, content=content, headers=headers)
        assert _check_error(r, status, None)["code"] == code
        assert eng.requests == []


@pytest.mark.parametrize("route,content,param", [
    (C, rb'{"prompt": "\ud800", "max_tokens": 2}', "prompt"),
    (C, rb'{"prompt": ["ok", "a\uDFFFb"], "max_tokens": 2}', "prompt[1]"),
    (C, rb'{"prompt": "hi", "stop": ["x", "\udc00"]}', "stop[1]"),
    (CHAT, rb'{"messages": [{"role": "user", "content": "\ud83d"}]}', "messages[0].content"),
    (CHAT, rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\udbff"}]}]}',
     "messages[0].content[0].text"),
    ("/tokenize", rb'{"prompt": "\ud800"}', "prompt"),
    (C, rb'{"prompt": "hi", "x\ud800": 1}', None),  # a field name: named in the message, not as param
])
async def test_unpaired_surrogates_are_a_400_naming_the_field(route, content, param):
    """A \\uD800-\\uDFFF escape without its pair leaves a string that is not Unicode: the tokenizer refused it
    with a TypeError (a 500 that closed the connection) and no answer can encode it."""
    eng = FakeAsyncLLM()
    async with await _app(eng) as c:
        r = await c.post(route, content=content, headers={"content-type": "application/json"})
        err = _check_error(r, 400, param)
        assert err["code"] == "invalid_encoding" and "surrogate" in err["message"], err
        if param is None:
            assert "x\\ud800" in err["message"], err
        assert eng.requests == []
        # a paired escape is one code point (U+1F600), and a literal backslash-u is just text
        ok = rb'{"prompt": "\ud83d\ude00 and \\ud800", "max_tokens": 2}'
        r = await c.post(C, content=ok, headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text


async def test_no_content_type_is_taken_as_json():
    async with await _app(FakeAsyncLLM()) as c:
        r = await c.post(C, content=json.dumps({"prompt": "hi", "max_tokens": 2}).encode())
        assert r.status_code == 200, r.text


async def test_body_limit_by_content_length_and_by_bytes_read():
    eng = FakeAsyncLLM()
    async with await _app(eng, max_request_body_bytes=1000) as c:
        big = json.dumps({"prompt": "x" * 2000}).encode()
        r = await c.post(C, content=big, headers={"content-type": "application/json"})
        assert _check_error(r, 413, None)["code"] == "request_too_large"

        async def chunks():  # no Content-Length: chunked, counted as it is read
            for _ in range(10):
                yield b" " * 200
        r = await c.post(C, content=chunks(), headers={"content-type": "application/json"})
        assert "content-length" not in r.request.headers
        _check_error(r, 413, None)
        r = await c.post(C, json={"prompt": "x" * 100, "max_tokens": 2})
        assert r.status_code == 200
    assert [ids for ids, _, _ in eng.requests] and len(eng.requests) == 1


async def test_unknown_routes_and_methods_use_the_error_body():
    async with await _app(FakeAsyncLLM()) as c:
        _check_error(await c.get(C), 405, None)
        _check_error(await c.post("/v1/nothing", json={}), 404, None)


async def test_unknown_fields_are_ignored_with_a_warning(caplog):
    eng = FakeAsyncLLM()
    async with await _app(eng) as c:
        r = await c.post(C, json={"prompt": "hi", "max_tokens": 2, "frobnicate": 1, "store": True,
                                  "tool_choice": "none", "logprobs": None})
        assert r.status_code == 200, r.text
    assert "frobnicate" in caplog.text and "store" in caplog.text


async def test_api_key_on_v1_routes_only():
    eng = FakeAsyncLLM()
    async with await _app(eng, api_key="s3cret") as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Bearer s3cret "}):
            r = await c.post(C, json={"prompt": "hi"}, headers=headers)
            err = _check_error(r, 401, None)
            assert "s3cret" not in r.text and err["code"] == "invalid_api_key"
            _check_error(await c.get("/v1/models", headers=headers), 401, None)
        ok = {"Authorization": "Bearer s3cret"}
        assert (await c.post(C, json={"prompt": "hi", "max_tokens": 2}, headers=ok)).status_code == 200
        assert (await c.get("/v1/models", headers=ok)).status_code == 200
        for path in ("/health", "/metrics"):
            assert (await c.get(path)).status_code == 200
        assert (await c.post("/tokenize", json={"prompt": "a"})).status_code == 200
    assert len(eng.requests) == 1


def test_server_config_rejects_bad_values():
    for kw in ({"max_waiting_requests": 0}, {"max_request_body_bytes": -1}, {"api_key": ""}, {"port": 70000},
               {"shutdown_grace_s": -1}):
        with pytest.raises(ValueError, match=next(iter(kw)).split("_s")[0]):
            ServerConfig(**kw)
