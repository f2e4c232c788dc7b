"""--reasoning-parser (entrypoints/openai/reasoning.py), as vLLM serves it: <think>...</think> to the
message's `reasoning`, the rest to its content; whole and streamed the same at any split; qwen3's
<tool_call> ends the reasoning and the hermes parser then reads the call; enable_thinking false and
include_reasoning false; through the server over a scripted fake engine."""
import json

import httpx
import pytest

from fake_engine_client import FakeAsyncLLM
from tdpipe.entrypoints.openai.api_server import build_app
from tdpipe.entrypoints.openai.reasoning import ReasoningStream, count_tokens, split
from tdpipe.entrypoints.openai.serve_args import ServerConfig

pytestmark = pytest.mark.anyio
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "2 + 2?"}]
THOUGHT = "<think>\nTwo and two.\n</think>\n\nFour."

CASES = [  # (parser, text) -> (reasoning, content)
    ("qwen3", THOUGHT, ("\nTwo and two.\n", "\n\nFour.")),
    ("deepseek_r1", "Two and two.</think>Four.", ("Two and two.", "Four.")),  # the template wrote <think>
    ("qwen3", "<think>still thinking", ("still thinking", None)),  # cut off: no content yet
    ("qwen3", "<think>hm <tool_call>{}</tool_call>", ("hm ", "<tool_call>{}</tool_call>")),
    ("deepseek_r1", "<think>hm <tool_call>{}</tool_call>", ("hm <tool_call>{}</tool_call>", None)),
    ("qwen3", "<think></think>x", ("", "x")),
]


@pytest.mark.parametrize("parser, text, want", CASES)
def test_split_whole_and_streamed_at_any_split(parser, text, want):
    assert split(parser, text) == want
    for step in (1, 2, 3, 7):
        s, thought, content = ReasoningStream(parser), "", ""
        for i in range(0, len(text), step):
            a, b = s.feed(text[i:i + step])
            thought, content = thought + a, content + b
        thought += s.finish()
        assert (thought, (content or None) if not s.in_reasoning else None) == want
        assert "<think>" not in thought


def test_without_thinking_everything_is_content():
    assert split("qwen3", THOUGHT, thinking=False) == (None, THOUGHT)
    assert ReasoningStream("qwen3", thinking=False).feed("a</think>b") == ("", "a</think>b")


def test_server_config_checks_the_parser():
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, qwen3"):
        ServerConfig(reasoning_parser="r2")


async def _post(script: str, body: dict, **cfg) -> httpx.Response:
    eng = FakeAsyncLLM(max_model_len=1024)
    eng.script = script
    app = build_app(eng, ServerConfig(**cfg))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        return await c.post(CHAT, json={"messages": USER, **body})


def _stream_parts(r: httpx.Response) -> tuple[str, str, list, list]:
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
    return ("".join(d.get("reasoning") or "" for d in deltas), "".join(d.get("content") or "" for d in deltas),
            [c for d in deltas for c in d.get("tool_calls") or []], finish)


async def test_reasoning_in_the_message_and_the_stream():
    r = await _post(THOUGHT, {}, reasoning_parser="qwen3")
    msg = r.json()["choices"][0]["message"]
    assert (msg["reasoning"], msg["content"]) == ("\nTwo and two.\n", "\n\nFour.")
    r = await _post(THOUGHT, {"stream": True}, reasoning_parser="qwen3")
    thought, content, _, finish = _stream_parts(r)
    assert (thought, content, finish[-1]) == ("\nTwo and two.\n", "\n\nFour.", "stop")
    plain = (await _post(THOUGHT, {})).json()["choices"][0]["message"]  # no parser: the text as it came
    assert plain == {"role": "assistant", "content": THOUGHT}


async def test_include_reasoning_false_and_enable_thinking_false():
    msg = (await _post(THOUGHT, {"include_reasoning": False}, reasoning_parser="qwen3")).json()
    assert msg["choices"][0]["message"] == {"role": "assistant", "content": "\n\nFour."}
    r = await _post(THOUGHT, {"include_reasoning": False, "stream": True}, reasoning_parser="qwen3")
    assert _stream_parts(r)[:2] == ("", "\n\nFour.")
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    msg = (await _post("Four.", off, reasoning_parser="qwen3")).json()["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "Four."}


async def test_cut_off_inside_the_reasoning_has_no_content():
    r = await _post("<think>and so on", {"max_tokens": 11}, reasoning_parser="deepseek_r1")
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] is None and choice["message"]["reasoning"] == "and "
    assert choice["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_call_after_the_reasoning_is_parsed(stream):
    script = '<think>I need the weather.</think>\n<tool_call>\n{"name": "w", "arguments": {"c": 1}}\n</tool_call>'
    tools = [{"type": "function", "function": {"name": "w"}}]
    r = await _post(script, {"tools": tools, "stream": stream}, reasoning_parser="qwen3",
                    enable_auto_tool_choice=True, tool_call_parser="hermes")
    if stream:
        thought, content, calls, finish = _stream_parts(r)
        finish = finish[-1]
    else:
        choice = r.json()["choices"][0]
        msg, finish = choice["message"], choice["finish_reason"]
        thought, content, calls = msg["reasoning"], msg["content"], msg["tool_calls"]
    assert thought == "I need the weather." and not (content or "").strip() and finish == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("w", {"c": 1})]


async def test_a_constrained_answer_has_no_reasoning():
    """A forced call or structured output holds the answer to a grammar from its first token: with a
    reasoning parser the whole answer is still the call (or the content), never reasoning."""
    tools = [{"type": "function", "function": {"name": "w"}}]
    r = await _post('{"c": 1}', {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "w"}}},
                    reasoning_parser="qwen3")
    msg = r.json()["choices"][0]["message"]
    assert "reasoning" not in msg and [(c["function"]["name"], c["function"]["arguments"])
                                       for c in msg["tool_calls"]] == [("w", '{"c": 1}')]
    r = await _post('{"a": 2}', {"response_format": {"type": "json_object"}}, reasoning_parser="qwen3")
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": '{"a": 2}'}


class MarkerTok:
    """Markers as single tokens (as Qwen3's and DeepSeek-R1's tokenizers have them): <think> 1, </think> 2,
    <tool_call> 3; any other id is a word."""

    def convert_tokens_to_ids(self, t: str) -> int | None:
        return {"<think>": 1, "</think>": 2, "<tool_call>": 3}.get(t)


@pytest.mark.parametrize("parser, ids, thinking, want", [
    ("qwen3", [1, 10, 11, 12, 2, 13, 14], True, 3),  # <think> a b c </think> d e
    ("deepseek_r1", [10, 11, 2, 13], True, 2),  # the template wrote <think>
    ("qwen3", [1, 10, 11], True, 2),  # cut off inside the reasoning: all of it
    ("qwen3", [1, 10, 3, 11, 2], True, 1),  # qwen3: a <tool_call> ends it
    ("deepseek_r1", [1, 10, 3, 11, 2], True, 3),  # deepseek_r1: not
    ("qwen3", [1, 10, 2, 13], False, 0),  # enable_thinking false: no reasoning
    ("qwen3", [], True, 0),
])
def test_reasoning_tokens_counted_by_marker_ids(parser, ids, thinking, want):
    assert count_tokens(parser, ids, MarkerTok(), thinking) == want


async def test_usage_reports_reasoning_tokens_with_a_parser():
    """usage.completion_tokens_details.reasoning_tokens (vLLM's, with a reasoning parser): whole and in a
    stream's usage chunk; absent without a parser. The fake tokenizer is byte-level, so the markers span
    several tokens and the reasoning's text is tokenised again: "\nTwo and two.\n" is 14 bytes."""
    r = await _post(THOUGHT, {}, reasoning_parser="qwen3")
    assert r.json()["usage"]["completion_tokens_details"] == {"reasoning_tokens": 14}
    r = await _post(THOUGHT, {"stream": True, "stream_options": {"include_usage": True}}, reasoning_parser="qwen3")
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 14}
    body = (await _post(THOUGHT, {"include_reasoning": False}, reasoning_parser="qwen3")).json()
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 14}  # counted, not shown (vLLM)
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    body = (await _post("Four.", off, reasoning_parser="qwen3")).json()
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    assert "completion_tokens_details" not in (await _post(THOUGHT, {})).json()["usage"]
