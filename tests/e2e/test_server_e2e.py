"""The real server (`tdpipe serve`: uvicorn on 127.0.0.1, the real AsyncLLM and engine-core process, the
bundled model in float32) driven by the real `openai` client: completions and chat, streaming and not, stop
strings, seeds, usage, models, metrics, the API key, greedy output token-identical to LLM.generate at pp = 1
and pp = 2, the bad-input matrix, 50 clients hanging up, SIGTERM under load. One server per module."""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from procs import alive, descendants
from server_inputs import bad_inputs

pytestmark = pytest.mark.slow

KEY = "e2e-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def start_server(log_path, *flags: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`tdpipe serve` on a free port (--port 0); returns once it says where it listens."""
    log = open(log_path, "w+")
    cmd = [sys.executable, "-m", "tdpipe.cli", "serve", "--port", "0", "--dtype", "float32",
           "--kv-cache-memory", str(64 << 20), "--no-access-log", *flags]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    for _ in range(1500):  # model load and, at pp > 1, the stage processes
        m = re.search(r"serving \S+ on (http://\S+)", open(log_path).read())
        if m:
            return proc, m.group(1)
        assert proc.poll() is None, open(log_path).read()
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the server did not start: " + open(log_path).read()[-2000:])


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM: exit 0 and no process left (the engine core and its stages)."""
    pids = [proc.pid, *descendants(proc.pid)]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 0
    for _ in range(100):
        if not any(alive(p) for p in pids):
            break
        time.sleep(0.1)
    assert not any(alive(p) for p in pids), [p for p in pids if alive(p)]


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.labels:
                out[s.name] = s.value
    return out


def wait_idle(url: str) -> dict[str, float]:
    """The engine's snapshot once nothing runs or waits (it refreshes every step, each second when idle)."""
    for _ in range(600):
        m = metrics(url)
        if m["tdpipe:num_requests_running"] == 0 and m["tdpipe:num_requests_waiting"] == 0 and \
                m["tdpipe:kv_cache_usage_perc"] == 0:
            return m
        time.sleep(0.1)
    raise AssertionError(f"the engine did not go idle: {m}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, url = start_server(tmp_path_factory.mktemp("serve") / "serve.log", "--max-num-seqs", "8",
                             "--enable-prompt-tokens-details", "--enable-auto-tool-choice", "--tool-call-parser",
                             "hermes", env={"TDPIPE_API_KEY": KEY})
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    with OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=300) as c:
        yield c


def test_completions_and_chat_streaming_and_not(server, client):
    model = client.models.list().data[0].id
    r = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    ids = httpx.post(server + "/tokenize", json={"prompt": PROMPTS[0]}).json()["tokens"]
    usage = (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens)
    assert usage == (len(ids), 6, len(ids) + 6)
    assert r.choices[0].finish_reason == "length" and r.id.startswith("cmpl-") and r.model == model
    stream = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    chat = client.chat.completions.create(model=model, messages=msgs, max_completion_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert chat.usage.completion_tokens <= 8
    tok = httpx.post(server + "/tokenize", json={"messages": msgs}).json()
    assert chat.usage.prompt_tokens == tok["count"]
    parts = list(client.chat.completions.create(model=model, messages=msgs, max_completion_tokens=8,
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
    assert parts[0].choices[0].delta.role == "assistant"
    streamed = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    assert streamed == chat.choices[0].message.content
    assert parts[-1].usage.completion_tokens == chat.usage.completion_tokens


def test_tool_calls_with_the_openai_client(client):
    """A named call (the output held to the tool's parameters), and under "auto" the model's hermes text
    parsed into calls, whole and streamed; the answer is forced into a call with a regex, since this small
    model's template knows no tools."""
    model = client.models.list().data[0].id
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"]}}}]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model=model, messages=msgs, tools=tools, max_completion_tokens=32,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = r.choices[0].message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    regex = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n</tool_call>'
    kw = dict(model=model, messages=msgs, tools=tools, max_completion_tokens=64, temperature=0,
              extra_body={"structured_outputs": {"regex": regex}})
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
    assert [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')]
    parts = [p for p in client.chat.completions.create(**kw, stream=True) if p.choices]
    calls = [c for p in parts for c in p.choices[0].delta.tool_calls or []]
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == [
        (0, "get_weather", '{"city": "Paris"}')]
    assert parts[-1].choices[0].finish_reason == "tool_calls"


def test_stop_strings_max_tokens_and_seeds(client):
    model = client.models.list().data[0].id
    full = client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=16,
                                     temperature=0).choices[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    cut = client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == full[:full.index(stop)]
    assert cut.choices[0].model_extra["stop_reason"] == stop
    for n in (1, 5):
        r = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=n,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == n and r.choices[0].finish_reason == "length"
    texts = [client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=12, temperature=1.0, seed=s,
                                       extra_body={"ignore_eos": True}).choices[0].text for s in (11, 11, 12)]
    assert texts[0] == texts[1]
    assert texts[0] != texts[2]


def test_beam_search_on_the_real_model(client):
    """use_beam_search through the openai client: one beam is the greedy answer; three beams are three
    different answers of max_tokens each (ignore_eos); chat's too."""
    model = client.models.list().data[0].id
    greedy = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    one = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, n=1,
                                    extra_body={"use_beam_search": True, "ignore_eos": True})
    assert one.choices[0].text == greedy
    three = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, n=3,
                                      extra_body={"use_beam_search": True, "ignore_eos": True,
                                                  "return_token_ids": True})
    texts = [c.text for c in three.choices]
    assert len(texts) == 3 and len(set(texts)) == 3 and three.usage.completion_tokens == 24
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[0]}],
                                          max_tokens=6, n=2, extra_body={"use_beam_search": True})
    assert len(chat.choices) == 2 and all(c.message.content for c in chat.choices)


def test_models_metrics_and_api_key(server, client):
    from openai import AuthenticationError, OpenAI

    models = client.models.list().data
    assert len(models) == 1 and models[0].model_extra["max_model_len"] > 0
    with OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0) as other:
        with pytest.raises(AuthenticationError):
            other.completions.create(model=models[0].id, prompt="hi", max_tokens=1)
    assert httpx.get(server + "/v1/models").status_code == 401  # no key at all
    assert httpx.get(server + "/health").json() == {"status": "ok"}  # open without the key
    client.completions.create(model=models[0].id, prompt="hi", max_tokens=3, extra_body={"ignore_eos": True})
    text = httpx.get(server + "/metrics").text
    names = {f.name for f in text_string_to_metric_families(text)}
    for n in ("tdpipe:num_requests_running", "tdpipe:num_requests_waiting", "tdpipe:kv_cache_usage_perc",
              "tdpipe:prompt_tokens", "tdpipe:generation_tokens", "tdpipe:num_preemptions",
              "tdpipe:time_to_first_token_seconds", "tdpipe:time_per_output_token_seconds",
              "tdpipe:e2e_request_latency_seconds", "tdpipe:stage_busy_ratio"):
        assert n in names, n
    m = metrics(server)
    assert m["tdpipe:generation_tokens_total"] >= 3 and m["tdpipe:time_to_first_token_seconds_count"] >= 1
    assert 'tdpipe:stage_busy_ratio{stage="0"}' in text
    # the same 40-token prompt twice: the second finds its two full blocks in the prefix cache
    long = "The quick brown fox jumps over the lazy dog. " * 4
    before = metrics(server)
    for _ in range(2):
        client.completions.create(model=models[0].id, prompt=long, max_tokens=1)
    after = metrics(server)
    assert after["tdpipe:prefix_cache_hits_total"] - before["tdpipe:prefix_cache_hits_total"] >= 32
    assert after["tdpipe:prefix_cache_queries_total"] > before["tdpipe:prefix_cache_queries_total"]
    assert 0 < after["tdpipe:prefix_cache_hit_rate"] <= 1


def test_n_samples_and_logprobs(client):
    """n, best_of and logprobs through the real openai client: greedy samples equal the greedy answer, seeded
    samples reproduce, logprobs have OpenAI's shapes (legacy completions, chat content)."""
    model = client.models.list().data[0].id
    one = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].text
    three = client.completions.create(model=model, prompt=[PROMPTS[0], PROMPTS[1]], n=3, max_tokens=8,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in three.choices] == list(range(6)) and three.usage.completion_tokens == 48
    assert [c.text for c in three.choices[:3]] == [one] * 3
    seeded = [[c.text for c in client.completions.create(model=model, prompt=PROMPTS[1], n=2, max_tokens=10,
                                                         temperature=1.0, seed=7,
                                                         extra_body={"ignore_eos": True}).choices]
              for _ in range(2)]
    assert seeded[0] == seeded[1] and seeded[0][0] != seeded[0][1]
    streamed = client.completions.create(model=model, prompt=PROMPTS[1], n=2, max_tokens=10, temperature=1.0,
                                         seed=7, stream=True, extra_body={"ignore_eos": True})
    texts = ["", ""]
    for ch in streamed:
        for c in ch.choices:
            texts[c.index] += c.text
    assert texts == seeded[0]

    r = client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=5, logprobs=2, temperature=1.0,
                                  seed=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and 2 <= len(top) <= 3 and top[tok] == val and max(top.values()) >= val
    best = client.completions.create(model=model, prompt=PROMPTS[2], n=2, extra_body={"best_of": 4,
                                     "ignore_eos": True}, max_tokens=5, temperature=1.0, seed=3)
    assert len(best.choices) == 2

    msgs = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model=model, messages=msgs, max_completion_tokens=6, temperature=0,
                                          n=2, logprobs=True, top_logprobs=2)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.logprob
        assert t.top_logprobs[0].token == t.token  # greedy: the most likely token
    parts = list(client.chat.completions.create(model=model, messages=msgs, max_completion_tokens=6,
                                                temperature=0, n=2, stream=True, logprobs=True, top_logprobs=1))
    got = {0: "", 1: ""}
    n_lp = {0: 0, 1: 0}
    for p in parts:
        for c in p.choices:
            got[c.index] += c.delta.content or ""
            n_lp[c.index] += len(c.logprobs.content) if c.logprobs else 0
    assert got[0] == got[1] == chat.choices[0].message.content and n_lp[0] == len(content)


def test_echo_scores_the_prompt_as_evaluation_harnesses_ask(server, client):
    """echo with logprobs returns the prompt's own logprobs before the answer's (vLLM: prompt_logprobs follows
    logprobs), which is how evaluation harnesses score a continuation; echo with max_tokens 0 returns the
    prompt alone, scored, with nothing generated. Streamed too: the echo chunk carries the prompt's logprobs."""
    model = client.models.list().data[0].id
    prompt = PROMPTS[0] + " Paris"
    n_prompt = len(httpx.post(server + "/tokenize", json={"prompt": prompt}).json()["tokens"])
    scored = client.completions.create(model=model, prompt=prompt, max_tokens=1, echo=True, logprobs=1,
                                       temperature=0).choices[0]
    lp = scored.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == n_prompt + 1
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == scored.text and scored.text.startswith(prompt)
    assert lp.text_offset[0] == 0 and lp.text_offset[-1] == len(prompt)  # the answer's token after the prompt
    explicit = client.completions.create(model=model, prompt=prompt, max_tokens=1, echo=True, logprobs=1,
                                         temperature=0, extra_body={"prompt_logprobs": 1}).choices[0].logprobs
    assert explicit.token_logprobs == lp.token_logprobs

    only = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                     temperature=0)
    c = only.choices[0]
    assert c.text == prompt and c.finish_reason == "length" and only.usage.completion_tokens == 0
    assert c.logprobs.token_logprobs == lp.token_logprobs[:-1] and c.logprobs.tokens == lp.tokens[:-1]
    bare = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True).choices[0]
    assert bare.text == prompt and bare.logprobs is None
    with pytest.raises(Exception, match="max_tokens"):  # without echo there is nothing to answer (vLLM too)
        client.completions.create(model=model, prompt=prompt, max_tokens=0)

    chunks = [ch.choices[0] for ch in client.completions.create(model=model, prompt=prompt, max_tokens=0,
                                                                   echo=True, logprobs=1, stream=True)]
    assert [ch.text for ch in chunks] == [prompt, ""] and chunks[-1].finish_reason == "length"
    assert chunks[0].logprobs.token_logprobs == lp.token_logprobs[:-1]


def test_continue_final_message_prefills_the_answer(server, client):
    """continue_final_message (vLLM's, transformers' name): the last message stays open and the model goes on
    with it; add_generation_prompt is then off unless the client also sends it true, a 400. With vLLM's chat
    echo the answer starts with that message."""
    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is"}]
    open_ids = httpx.post(server + "/tokenize", json={"messages": msgs, "continue_final_message": True}).json()
    closed = httpx.post(server + "/tokenize", json={"messages": msgs, "add_generation_prompt": False}).json()
    prefix = httpx.post(server + "/tokenize", json={"prompt": "The capital of France is",
                                                    "add_special_tokens": False}).json()["tokens"]
    assert open_ids["tokens"][-len(prefix):] == prefix  # nothing after the prefill: no end of turn
    assert closed["tokens"][:len(open_ids["tokens"])] == open_ids["tokens"] and closed["count"] > open_ids["count"]
    r = client.chat.completions.create(model=model, messages=msgs, max_completion_tokens=4, temperature=0,
                                       extra_body={"continue_final_message": True, "ignore_eos": True})
    same = client.completions.create(model=model, prompt=open_ids["tokens"], max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == same.choices[0].text  # it ran the open prompt
    assert r.usage.prompt_tokens == open_ids["count"]
    bad = httpx.post(server + "/v1/chat/completions", headers=AUTH, json={
        "messages": msgs, "continue_final_message": True, "add_generation_prompt": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "continue_final_message"
    # vLLM's chat echo: the continued message comes back whole, the prefill then the new tokens, streamed too
    kw = dict(model=model, messages=msgs, max_completion_tokens=4, temperature=0,
              extra_body={"continue_final_message": True, "ignore_eos": True, "echo": True})
    echoed = client.chat.completions.create(**kw)
    assert echoed.choices[0].message.content == msgs[-1]["content"] + r.choices[0].message.content
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(**kw, stream=True)
                       if ch.choices)
    assert streamed == echoed.choices[0].message.content
    # with a generation prompt after a user message there is nothing of the answer's to echo
    plain = client.chat.completions.create(model=model, messages=msgs[:1], max_completion_tokens=3, temperature=0)
    again = client.chat.completions.create(model=model, messages=msgs[:1], max_completion_tokens=3, temperature=0,
                                           extra_body={"echo": True})
    assert again.choices[0].message.content == plain.choices[0].message.content


def test_logit_bias_forces_and_bans_tokens(server, client):
    """OpenAI's logit_bias ({"token id": bias in [-100, 100]}), completions and chat: +100 makes a greedy answer
    that token throughout, -100 on the greedy answer's first token changes it; vLLM's allowed_token_ids."""
    model = client.models.list().data[0].id
    tok = httpx.post(server + "/tokenize", json={"prompt": " banana", "add_special_tokens": False}).json()["tokens"][0]
    r = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                  logit_bias={str(tok): 100}, extra_body={"return_token_ids": True, "ignore_eos": True})
    assert r.choices[0].token_ids == [tok] * 4
    plain = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=1, temperature=0,
                                      extra_body={"return_token_ids": True}).choices[0].token_ids[0]
    moved = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=1, temperature=0,
                                      logit_bias={str(plain): -100}, extra_body={"return_token_ids": True})
    assert moved.choices[0].token_ids[0] != plain
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                          max_completion_tokens=3, temperature=0, logit_bias={str(tok): 100},
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == " banana" * 3
    # vLLM's allowed_token_ids: the answer holds only those tokens (a label set)
    labels = [httpx.post(server + "/tokenize", json={"prompt": w, "add_special_tokens": False}).json()["tokens"][0]
              for w in (" yes", " no")]
    r = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=5, temperature=1.0, seed=3,
                                  extra_body={"allowed_token_ids": labels, "return_token_ids": True,
                                              "ignore_eos": True})
    assert set(r.choices[0].token_ids) <= set(labels) and len(r.choices[0].token_ids) == 5


def test_bad_words_and_truncate_prompt_tokens(server, client):
    """vLLM's bad_words keeps a word out of the greedy answer; truncate_prompt_tokens=k runs the prompt's last
    k tokens: the usage counts k, and the answer is the one those k ids get."""
    model = client.models.list().data[0].id
    plain = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=6, temperature=0)
    word = plain.choices[0].text.split()[0]
    r = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                  extra_body={"bad_words": [word]})
    assert word not in r.choices[0].text.split() and r.choices[0].text != plain.choices[0].text
    ids = httpx.post(server + "/tokenize", json={"prompt": PROMPTS[1]}).json()["tokens"]
    r = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=5, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 4, "return_token_ids": True})
    assert r.usage.prompt_tokens == 4 and r.choices[0].prompt_token_ids == ids[-4:]
    same = client.completions.create(model=model, prompt=ids[-4:], max_tokens=5, temperature=0)
    assert r.choices[0].text == same.choices[0].text


def test_prompt_tokens_details_count_the_cached_prefix(client):
    """--enable-prompt-tokens-details (vLLM's flag): OpenAI's usage.prompt_tokens_details.cached_tokens, 0 for
    a prompt the cache has not seen, whole blocks of 16 once it has, streamed usage too."""
    model = client.models.list().data[0].id
    prompt = "Tally of the ledger: " + " ".join(f"item{i} costs {i * 7 % 13} coins" for i in range(30))
    first = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached % 16 == 0 and first.usage.prompt_tokens - 16 <= cached < first.usage.prompt_tokens
    chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                 max_completion_tokens=2, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0



    """response_format json_schema sampled at temperature 1 (n = 3, streamed too) parses and validates;
    json_object, vLLM's structured_outputs and guided_choice work; a bad schema is a 400 naming the field."""
    import jsonschema
    import openai

    model = client.models.list().data[0].id
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 10 ** 8},
                                               "capital": {"type": "boolean"}},
              "required": ["city", "population", "capital"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}
    msgs = [{"role": "user", "content": "Describe a city as JSON."}]
    r = client.chat.completions.create(model=model, messages=msgs, response_format=fmt, temperature=1.0, n=3,
                                       seed=11, max_completion_tokens=200)
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), schema)
    texts = {}
    for ch in client.chat.completions.create(model=model, messages=msgs, response_format=fmt, temperature=1.0,
                                             n=3, seed=11, max_completion_tokens=200, stream=True):
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert [texts[i] for i in range(3)] == [c.message.content for c in r.choices]
    obj = client.chat.completions.create(model=model, messages=msgs, response_format={"type": "json_object"},
                                         temperature=0, max_completion_tokens=100)
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    pick = client.completions.create(model=model, prompt="Is the sky blue?", max_tokens=5, temperature=1.0, n=4,
                                     extra_body={"guided_choice": ["yes", "no"]})
    assert {c.text for c in pick.choices} <= {"yes", "no"}
    num = client.completions.create(model=model, prompt="A number:", max_tokens=8, temperature=1.0,
                                    extra_body={"structured_outputs": {"regex": r"[1-9][0-9]{2}"}})
    assert re.fullmatch(r"[1-9][0-9]{2}", num.choices[0].text)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "no-such-type"}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=msgs, response_format=bad)
    assert e.value.body["param"] == "response_format.json_schema.schema"
    assert "not a valid JSON schema" in e.value.body["message"]


def _greedy_ids_via_server(url: str, headers: dict) -> list[list[int]]:
    out = []
    for p in PROMPTS:
        r = httpx.post(url + "/v1/completions", headers=headers, timeout=300,
                       json={"prompt": p, "max_tokens": 12, "temperature": 0, "return_token_ids": True})
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["token_ids"])
    return out


def _greedy_ids_offline(llm) -> list[list[int]]:
    from tdpipe import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_is_token_identical_to_llm_generate_pp1(server, llm_fp32):
    assert _greedy_ids_via_server(server, AUTH) == _greedy_ids_offline(llm_fp32)


def test_greedy_is_token_identical_to_llm_generate_pp2(tmp_path, llm_fp32):
    proc, url = start_server(tmp_path / "serve_pp2.log", "--pp", "2")
    try:
        via_server = _greedy_ids_via_server(url, {})
    finally:
        stop_server(proc)
    assert via_server == _greedy_ids_offline(llm_fp32)


def test_bad_input_matrix_leaks_nothing(server):
    max_len = httpx.get(server + "/v1/models", headers=AUTH).json()["data"][0]["max_model_len"]
    cases = bad_inputs(max_len, fake_template=False)
    assert len(cases) >= 25
    with httpx.Client(base_url=server, headers=AUTH, timeout=60) as c:
        for route, body, status, param in cases:
            r = c.post(route, json=body)
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == param and set(err) == {"message", "type", "param", "code"}, (body, err)
        raw = [(b'{"prompt": "hi", ', "application/json", 400),
               (b'{"prompt": "\xff"}', "application/json", 400),
               (b'{"prompt": "hi"}', "text/plain", 415), (b"[1, 2]", "application/json", 400),
               (rb'{"prompt": "\ud800", "max_tokens": 2}', "application/json", 400),  # the tokenizer's TypeError
               (rb'{"messages": [{"role": "user", "content": "\udc00"}]}', "application/json", 400),
               (b'{"prompt": "' + b"x" * (9 << 20) + b'"}', "application/json", 413)]
        for content, ctype, status in raw:
            route = "/v1/chat/completions" if content.startswith(b'{"messages"') else "/v1/completions"
            r = c.post(route, content=content, headers={"content-type": ctype})
            assert r.status_code == status and "error" in r.json(), r.text
        r = c.post("/v1/completions", json={"prompt": "still there?", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    wait_idle(server)  # every KV block back in the free list


def test_50_streaming_clients_hang_up_others_still_served(server):
    before = wait_idle(server)["tdpipe:generation_tokens_total"]
    max_tokens = 64
    rng = random.Random(0)

    async def hang_up(c: httpx.AsyncClient, i: int) -> int:
        stop_after = rng.randrange(0, 8)  # 0: at once, maybe still queued behind --max-num-seqs 8
        seen = 0
        async with c.stream("POST", "/v1/completions", json={
                "prompt": f"Client {i} tells a long story:", "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if seen >= stop_after:
                    break
                if line.startswith("data: "):
                    seen += 1
        return seen  # leaving the block closes the connection mid-stream

    async def served(c: httpx.AsyncClient, i: int) -> dict:
        r = await c.post("/v1/completions", json={"prompt": f"Question {i}:", "max_tokens": 5,
                                                  "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()

    async def main():
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server, headers=AUTH, timeout=300, limits=limits) as c:
            return await asyncio.gather(*[hang_up(c, i) for i in range(50)],
                                        *[served(c, i) for i in range(5)])

    results = asyncio.run(main())
    assert all(r["usage"]["completion_tokens"] == 5 and r["choices"][0]["finish_reason"] == "length"
               for r in results[50:])
    after = wait_idle(server)  # all their blocks freed
    # aborted, not run to the end: far fewer tokens than 50 full answers
    generated = after["tdpipe:generation_tokens_total"] - before
    print(f"50 clients hung up after {sorted(results[:50])} events; {generated:.0f} tokens generated in all")
    assert generated < 50 * max_tokens / 2
    r = httpx.post(server + "/v1/completions", headers=AUTH, json={"prompt": "after", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200


def test_sigterm_under_load_exits_0_and_leaves_nothing(tmp_path):
    proc, url = start_server(tmp_path / "serve_term.log", "--shutdown-grace", "3")
    results: list = []

    def stream(i: int) -> None:
        events = []
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
                    "prompt": f"Story {i}:", "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
        except httpx.HTTPError as e:
            events.append(f"transport error: {e}")
        results.append(events)

    def plain(i: int) -> None:
        try:
            r = httpx.post(url + "/v1/completions", timeout=120,
                           json={"prompt": f"Essay {i}:", "max_tokens": 400, "ignore_eos": True})
            results.append((r.status_code, r.json()))
        except httpx.HTTPError as e:
            results.append(("transport error", str(e)))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)] + \
              [threading.Thread(target=plain, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for _ in range(600):
        if metrics(url)["tdpipe:generation_tokens_total"] >= 8:
            break
        time.sleep(0.1)
    stop_server(proc)  # exit 0, no process left
    for t in threads:
        t.join(60)
    assert len(results) == 6
    for res in results:
        if isinstance(res, tuple):  # whole answers: done in the grace period, or 503 after it
            status, body = res
            assert status == 200 or (status == 503 and body["error"]["code"] == "server_shutdown"), res
        else:  # streams: finished, or an error event; either way [DONE] ends them, never a cut connection
            assert res and res[-1] == "[DONE]", res[-3:]
            last = json.loads(res[-2])
            assert "error" in last and last["error"]["code"] == "server_shutdown" or \
                last["choices"][0]["finish_reason"] == "length", last


def test_engine_core_death_fails_requests_then_the_server_exits_1(tmp_path):
    """No zombie: the open stream gets its error event, then the server logs one line and exits 1 (a
    supervisor restarts it), leaving no process behind."""
    log_path = tmp_path / "serve_dead.log"
    proc, url = start_server(log_path)
    pids = [proc.pid, *descendants(proc.pid)]
    core = next(p for p in pids[1:] if b"tdpipe.core.engine_core" in open(f"/proc/{p}/cmdline", "rb").read())
    events: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
                "prompt": "A long story:", "max_tokens": 1000, "ignore_eos": True, "stream": True}) as r:
            events.extend(line[6:] for line in r.iter_lines() if line.startswith("data: "))

    t = threading.Thread(target=stream)
    t.start()
    for _ in range(600):
        if len(events) >= 2 or not t.is_alive():
            break
        time.sleep(0.05)
    os.kill(core, signal.SIGKILL)
    t.join(120)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "engine_dead", events[-3:]
    assert "signal 9" in json.loads(events[-2])["error"]["message"]
    assert proc.wait(60) == 1
    errors = [line for line in open(log_path).read().splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1 and "engine core died" in errors[0] and "1 open requests failed" in errors[0], errors
    for _ in range(100):
        if not any(alive(p) for p in pids):
            break
        time.sleep(0.1)
    assert not any(alive(p) for p in pids), [p for p in pids if alive(p)]
