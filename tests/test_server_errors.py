"""The server's bad-input matrix against a fake engine: every invalid request is a 4xx with OpenAI's error
body naming the field, and none of them disturbs the engine (nothing left open, every KV block free, the
next good request answered)."""
from __future__ import annotations

import json

import httpx
import pytest

from fake_engine_client import FakeAsyncLLM
from tdpipe.entrypoints.openai.api_server import ServerConfig, build_app

pytestmark = pytest.mark.anyio

C, CHAT = "/v1/completions", "/v1/chat/completions"
U = [{"role": "user", "content": "hi"}]



def bad_inputs(max_model_len: int, fake_template: bool = True) -> list[tuple[str, dict, int, str]]:
    """(route, body, status, param): every one must fail with this status and name this field. Sized for
    the server's max_model_len; `fake_template`: include the conversation that the fake engine's template
    rejects (a system message after a user message; real templates differ)."""
    long = " x" * (2 * max_model_len)  # over max_model_len in any tokenizer: >= 1 token per " x"
    over = 10 * max_model_len
    cases = MATRIX + [
        (C, {"prompt": long}, 400, "prompt"),
        (C, {"prompt": "hi", "max_tokens": over}, 400, "max_tokens"),
        (CHAT, {"messages": [{"role": "user", "content": long}]}, 400, "messages"),
        (CHAT, {"messages": U, "max_completion_tokens": over}, 400, "max_completion_tokens"),
    ]
    if fake_template:
        late_system = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
        cases.append((CHAT, {"messages": late_system}, 400, "messages"))
    return cases


# the cases that hold for any model (bad_inputs adds those sized by max_model_len)
MATRIX = [
    (C, {}, 400, "prompt"),
    (C, {"prompt": 5}, 400, "prompt"),
    (C, {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": [1, "a"]}, 400, "prompt"),
    (C, {"prompt": [-1, 5]}, 400, "prompt"),
    (C, {"prompt": [99999]}, 400, "prompt"),
    (C, {"prompt": [[]]}, 400, "prompt"),
    (C, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": "10"}, 400, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": 10.0}, 400, "max_tokens"),
    (C, {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    (C, {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    (C, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    (C, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    (C, {"prompt": "hi", "n": 9}, 400, "n"),  # more than max_num_seqs (4 in the fake, 8 in the e2e server)
    (C, {"prompt": "hi", "n": 10**9}, 400, "n"),
    (C, {"prompt": "hi", "n": 0}, 400, "n"),
    (C, {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    (C, {"prompt": "hi", "frequency_penalty": -2.5}, 400, "frequency_penalty"),
    (C, {"prompt": "hi", "seed": "x"}, 400, "seed"),
    (C, {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    (C, {"prompt": "hi", "stop": 5}, 400, "stop"),
    (C, {"prompt": "hi", "stop": [""]}, 400, "stop"),
    (C, {"prompt": "hi", "stop": ["a", 1]}, 400, "stop"),
    (C, {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    (C, {"prompt": "hi", "min_p": 2}, 400, "min_p"),
    (C, {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (C, {"prompt": "hi", "min_tokens": -1}, 400, "min_tokens"),
    (C, {"prompt": "hi", "min_tokens": 20, "max_tokens": 5}, 400, "min_tokens"),
    (C, {"prompt": "hi", "ignore_eos": "yes"}, 400, "ignore_eos"),
    (C, {"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    (C, {"prompt": "hi", "skip_special_tokens": 0}, 400, "skip_special_tokens"),
    (C, {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    (C, {"prompt": "hi", "logprobs": -1}, 400, "logprobs"),
    (C, {"prompt": "hi", "logprobs": True}, 400, "logprobs"),
    (C, {"prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    (C, {"prompt": "hi", "echo": "true"}, 400, "echo"),
    (C, {"prompt": "hi", "stream": 1}, 400, "stream"),
    (C, {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (C, {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}}, 400,
     "stream_options.include_usage"),
    (C, {"prompt": "hi", "logit_bias": {"5": 10}}, 400, "logit_bias"),
    (C, {"prompt": "hi", "best_of": 0}, 400, "best_of"),
    (C, {"prompt": "hi", "n": 3, "best_of": 2}, 400, "best_of"),
    (C, {"prompt": "hi", "best_of": 9}, 400, "best_of"),
    (C, {"prompt": "hi", "best_of": 2, "stream": True}, 400, "best_of"),
    (C, {"prompt": "hi", "suffix": "end"}, 400, "suffix"),
    (C, {"prompt": "hi", "user": 5}, 400, "user"),
    (C, {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages[0].content[0]"),
    (CHAT, {"messages": U, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CHAT, {"messages": U, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    (CHAT, {"messages": U, "response_format": {"type": "json_object"}}, 400, "response_format"),
    (CHAT, {"messages": U, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": U, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (CHAT, {"messages": U, "logprobs": 1}, 400, "logprobs"),
    (CHAT, {"messages": U, "n": 9}, 400, "n"),
    (CHAT, {"messages": U, "model": "other"}, 404, "model"),
    ("/tokenize", {"prompt": "a", "messages": U}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
]


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
