"""Tool calling on /v1/chat/completions (entrypoints/openai/tool_calls.py), as vLLM serves it: the hermes
parser whole and streamed (every split of the text gives the same calls), tool_choice's rules and errors,
and the server over a fake engine whose answer is scripted: tools reach the template, calls come back in the
message or the stream, forced calls are held to their schema, earlier calls go back into the template."""
import json

import httpx
import pytest

from fake_engine_client import FakeAsyncLLM
from tdpipe.entrypoints.openai.api_server import build_app
from tdpipe.entrypoints.openai.serve_args import ServerConfig
from tdpipe.entrypoints.openai.tool_calls import HermesStream, parse_hermes, plan

pytestmark = pytest.mark.anyio
CHAT = "/v1/chat/completions"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
CALLS = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
USER = [{"role": "user", "content": "Weather and time in Paris?"}]


def _names_args(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


# -- the parser --------------------------------------------------------------------------------------------

def test_hermes_content_and_calls():
    content, calls = parse_hermes(CALLS)
    assert content == "I will check."
    assert _names_args(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert parse_hermes("just text") == ("just text", [])
    bad = 'x <tool_call>{"name": oops}</tool_call>'
    assert parse_hermes(bad) == (bad, [])  # not a call: the text stays the answer, as vLLM leaves it
    assert parse_hermes("<tool_call>{\"name\": \"f\"") == ("<tool_call>{\"name\": \"f\"", [])  # never closed


@pytest.mark.parametrize("step", [1, 2, 5, 11, len(CALLS)])
def test_hermes_stream_gives_the_same_calls_at_any_split(step):
    h, content, calls = HermesStream(), "", []
    for i in range(0, len(CALLS), step):
        c, new = h.feed(CALLS[i:i + step])
        assert "<" not in c  # a tag's first characters are held back, never sent as content
        content, calls = content + c, calls + new
    content += h.finish()
    assert content.strip() == "I will check."
    assert _names_args(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_hermes_stream_releases_held_text_that_was_not_a_call():
    h = HermesStream()
    assert h.feed("a <tool") == ("a ", [])
    assert h.feed("box> b") == ("<toolbox> b", [])
    h = HermesStream()
    assert h.feed("c <tool_") == ("c ", [])
    assert h.finish() == "<tool_"  # the answer ended on it: it was text
    h = HermesStream()
    h.feed("<tool_call>{\"name\": ")
    assert h.finish() == "<tool_call>{\"name\": "  # a call left open (max_tokens) is the answer's text


def test_offline_chat_prompt_takes_tools_and_earlier_calls():
    """LLM.chat's path (vLLM's tools keyword): the template sees the tools, and an assistant's earlier call
    with content None and its arguments as an object."""
    from fake_engine_client import FakeTokenizer
    from tdpipe.entrypoints.conversation import check_conversation, template_conversation
    from tdpipe.tokenizer import chat_prompt

    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    conv = USER + [{"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "content": "-3 C", "tool_call_id": "c1"}]
    text, _ = chat_prompt(FakeTokenizer(), template_conversation(check_conversation(conv)), tools=[WEATHER])
    assert text.startswith("<|tools|>get_weather\n") and "get_weather([('city', 'Oslo')])" in text
    with pytest.raises(ValueError, match="message 1: 'content' must be a string"):
        check_conversation(USER + [{"role": "assistant", "content": None}])


# -- tool_choice -------------------------------------------------------------------------------------------

def _status(fn, *args):
    with pytest.raises(Exception) as e:
        fn(*args)
    return e.value.status, e.value.param, str(e.value.message)


@pytest.mark.parametrize("tools, choice, auto, param, words", [
    ([WEATHER], None, False, "tool_choice", "--enable-auto-tool-choice"),
    ([WEATHER], "auto", False, "tool_choice", "--tool-call-parser"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, True, "tool_choice.function.name", "nope"),
    ([WEATHER], "sometimes", True, "tool_choice", "sometimes"),
    ([], {"type": "function", "function": {"name": "f"}}, True, "tool_choice", "empty"),
    ({"a": 1}, None, True, "tools", "list"),
    ([{"type": "function", "function": {"name": ""}}], None, True, "tools[0].function.name", "non-empty"),
    ([WEATHER, WEATHER], None, True, "tools[1].function.name", "twice"),
    ([{"type": "retrieval"}], None, True, "tools[0]", "function"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, True,
     "tools[0].function.parameters", "schema"),
])
def test_bad_tools_and_choices_are_400s_naming_the_field(tools, choice, auto, param, words):
    status, got, message = _status(plan, tools, choice, auto, "hermes" if auto else None)
    assert (status, got) == (400, param) and words in message


def test_choices_resolve_as_vllm_does():
    assert plan(None, None, False, None).mode == "none"
    none = plan([WEATHER], "none", False, None)
    assert none.mode == "none" and none.tools is None  # the template does not see them
    auto = plan([WEATHER, CLOCK], None, True, "hermes")
    assert (auto.mode, auto.parser, auto.schema) == ("auto", "hermes", None) and auto.tools == [WEATHER, CLOCK]
    named = plan([WEATHER, CLOCK], {"type": "function", "function": {"name": "get_weather"}}, False, None)
    assert (named.mode, named.name, named.schema) == ("named", "get_weather", WEATHER["function"]["parameters"])
    req = plan([WEATHER, CLOCK], "required", False, None)
    assert req.schema["type"] == "array" and req.schema["minItems"] == 1
    assert [a["properties"]["name"]["enum"] for a in req.schema["items"]["anyOf"]] == [["get_weather"],
                                                                                     ["get_time"]]


def test_server_config_checks_the_flags():
    with pytest.raises(ValueError, match="needs tool_call_parser"):
        ServerConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool_call_parser must be one of hermes"):
        ServerConfig(tool_call_parser="mistral")


# -- through the server ------------------------------------------------------------------------------------

async def _client(engine, **cfg):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine, ServerConfig(**cfg))),
                             base_url="http://test")


AUTO = {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}


def _prompt(eng) -> str:
    return eng.tokenizer.decode(eng.requests[-1][0])


async def test_auto_calls_in_the_message():
    eng = FakeAsyncLLM(max_model_len=1024)
    eng.script = CALLS
    async with await _client(eng, **AUTO) as c:
        r = await c.post(CHAT, json={"messages": USER, "tools": [WEATHER, CLOCK]})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "I will check."
    assert _names_args(choice["message"]["tool_calls"]) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert _prompt(eng).startswith("<|tools|>get_weather,get_time\n")  # the template saw the tools


async def test_auto_without_a_call_is_a_plain_answer():
    eng = FakeAsyncLLM(max_model_len=1024)
    eng.script = "It is sunny."
    async with await _client(eng, **AUTO) as c:
        r = await c.post(CHAT, json={"messages": USER, "tools": [WEATHER]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"] == {"role": "assistant",
                                                                        "content": "It is sunny."}


async def test_auto_calls_streamed():
    eng = FakeAsyncLLM(max_model_len=1024)
    eng.script = CALLS
    async with await _client(eng, **AUTO) as c:
        r = await c.post(CHAT, json={"messages": USER, "tools": [WEATHER, CLOCK],
                                     "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls") or []]
    assert content.strip() == "I will check." and "<tool_call>" not in content
    assert [c["index"] for c in calls] == [0, 1]
    assert _names_args(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "tool_calls"


async def test_none_hides_the_tools():
    eng = FakeAsyncLLM(max_model_len=1024)
    eng.script = CALLS  # the model writes a call anyway: under "none" it is text
    async with await _client(eng, **AUTO) as c:
        r = await c.post(CHAT, json={"messages": USER, "tools": [WEATHER], "tool_choice": "none"})
    assert "<|tools|>" not in _prompt(eng)
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": CALLS}


@pytest.mark.parametrize("stream", [False, True])
async def test_named_call_is_held_to_its_schema(stream):
    eng = FakeAsyncLLM(max_model_len=1024)
    eng.script = '{"city": "Paris"}'
    body = {"messages": USER, "tools": [WEATHER, CLOCK], "stream": stream,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    async with await _client(eng) as c:  # no flags: a forced call needs no parser
        r = await c.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    so = eng.requests[-1][1].structured_outputs
    assert so is not None and so.json == WEATHER["function"]["parameters"]
    if stream:
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.text.splitlines()
                  if line.startswith("data: {") and json.loads(line[6:])["choices"]]
        calls = [c for d in deltas for c in d.get("tool_calls") or []]
        assert not "".join(d.get("content") or "" for d in deltas)
    else:
        msg = r.json()["choices"][0]["message"]
        calls = msg["tool_calls"]
        assert msg["content"] == "" and r.json()["choices"][0]["finish_reason"] == "stop"
    assert _names_args(calls) == [("get_weather", {"city": "Paris"})]


async def test_required_calls_one_or_more():
    eng = FakeAsyncLLM(max_model_len=1024)
    eng.script = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Rome"}}]'
    async with await _client(eng) as c:
        r = await c.post(CHAT, json={"messages": USER, "tools": [WEATHER, CLOCK], "tool_choice": "required"})
    assert eng.requests[-1][1].structured_outputs.json["type"] == "array"
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls"  # named calls keep "stop" (OpenAI's rule)
    assert _names_args(r.json()["choices"][0]["message"]["tool_calls"]) == [("get_time", {}),
                                                                           ("get_weather", {"city": "Rome"})]


async def test_forced_call_and_a_constraint_of_its_own_conflict():
    async with await _client(FakeAsyncLLM(max_model_len=1024)) as c:
        r = await c.post(CHAT, json={"messages": USER, "tools": [WEATHER], "tool_choice": "required",
                                     "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


async def test_earlier_calls_and_tool_results_go_back_into_the_template():
    eng = FakeAsyncLLM(max_model_len=1024)
    eng.script = "It is 18 C in Paris."
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
    messages = USER + [{"role": "assistant", "content": None, "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    async with await _client(eng, **AUTO) as c:
        r = await c.post(CHAT, json={"messages": messages, "tools": [WEATHER]})
        assert r.status_code == 200, r.text
        # the arguments reach the template as an object (templates write them with tojson)
        assert "<|assistant|>get_weather([('city', 'Paris')])\n<|tool|>18 C\n" in _prompt(eng)
        bad = USER + [{"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]}]
        r = await c.post(CHAT, json={"messages": bad, "tools": [WEATHER]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].tool_calls[0]"
        r = await c.post(CHAT, json={"messages": [{"role": "assistant", "content": None}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"


@pytest.mark.parametrize("stream", [False, True])
async def test_parallel_tool_calls_false_keeps_the_first_call(stream):
    eng = FakeAsyncLLM(max_model_len=1024)
    eng.script = CALLS
    async with await _client(eng, **AUTO) as c:
        r = await c.post(CHAT, json={"messages": USER, "tools": [WEATHER, CLOCK], "parallel_tool_calls": False,
                                     "stream": stream})
    if stream:
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.text.splitlines()
                  if line.startswith("data: {") and json.loads(line[6:])["choices"]]
        calls = [c for d in deltas for c in d.get("tool_calls") or []]
    else:
        calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert _names_args(calls) == [("get_weather", {"city": "Paris"})]
    req = plan([WEATHER, CLOCK], "required", False, None, parallel_tool_calls=False)
    assert req.schema["maxItems"] == 1 and req.single
