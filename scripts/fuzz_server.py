"""Careless and hostile request bodies against a running `tdpipe serve`: about 280 malformed or out-of-range
bodies and 57 valid but unusual combinations (streams with n and logprobs, echo scoring, structured output,
prefills, huge lists). Every answer must be 200 or a 4xx with OpenAI's error body; any 5xx, or a dropped
connection, is reported and makes the exit status 1.

    .venv/bin/tdpipe serve --port 8123 &
    .venv/bin/python scripts/fuzz_server.py http://127.0.0.1:8123

Cases the server once failed are in the tests (tests/unit/test_server_errors.py, tests/e2e/test_server_e2e.py).
"""
import json
import sys

import httpx

U = sys.argv[1].rstrip("/") if len(sys.argv) > 1 else "http://127.0.0.1:8000"
c = httpx.Client(timeout=120)
M = httpx.get(U + "/v1/models").json()["data"][0]["id"]
base_c = {"model": M, "prompt": "Hello", "max_tokens": 3}
base_ch = {"model": M, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
C, CH = "/v1/completions", "/v1/chat/completions"
msgs = [{"role": "user", "content": "Hi"}]


def add(path, body, raw=None):
    cases.append((path, body, raw))


cases = []
for k, vals in {
    "n": [0, -1, 2, 10**6, 1.5, "2", None, True],
    "best_of": [1, 3, 0, -2, None],
    "max_tokens": [0, -1, 10**20, 1.0, "5", True],
    "temperature": [-1, 0, 1e-30, 1e309, 1e38, 3.5e38, 1e-45, None, "x", [1]],
    "top_p": [0, -0.1, 1.1, 1e-45, None],
    "top_k": [0, -1, -2, 10**9, 1.5, None],
    "min_p": [-1, 2, 1e-45, None],
    "repetition_penalty": [0, -1, 1e-50, 1e50, 1e-38, 1.0000001, None],
    "presence_penalty": [-3, 3, 1e40, None],
    "frequency_penalty": [-2.5, 2.5, 1e-45],
    "logprobs": [0, 5, 20, 21, -1, 10**6, True, None],
    "echo": [True, 1, "yes"],
    "stop": ["", [""], ["a"] * 1000, "x" * 100000, [1, 2], None, [None]],
    "stop_token_ids": [[-1], [10**12], [0] * 10000, "1", [1.5]],
    "seed": [-1, 2**64, 2**63, -(2**63) - 1, 1.5, "1"],
    "logit_bias": [{"1": 100}, {"-1": 1}, {"999999999": 1}, {"a": 1}, {"1": 1e309}, {"1": -101}, []],
    "prompt": ["", [], [[]], [0], [-1], [10**9], [[1, 2], [3]], ["a", 1], None, [""] * 5, {"a": 1}],
    "suffix": ["x"],
    "user": [123],
    "min_tokens": [-1, 5, 10**9],
    "ignore_eos": ["x"],
    "use_beam_search": [True, "yes", 1],
    "length_penalty": [0.5, -3, 1e309, "x", None],
    "skip_special_tokens": [3],
    "include_stop_str_in_output": [1],
    "prompt_logprobs": [0, 5, -1, 21, 10**6],
    "stream": [True, "true", 2],
    "stream_options": [{"include_usage": True}, {"include_usage": "x"}, "x"],
    "response_format": [{"type": "json_object"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}, {"type": "bogus"}, "x"],
    "guided_json": [{"type": "object"}, "notjson", 5],
    "guided_regex": ["(", "a+"],
    "guided_choice": [[], ["a"], [1]],
    "model": ["nope", "", None, 5],
    "bad_words": [["x"], [""], ["  "], "x", [1], ["a"] * 65, ["x" * 300], ["\ud800"], [" the", "a b c"]],
    "truncate_prompt_tokens": [1, -1, 0, -2, 10**9, 1.5, "3", True],
}.items():
    for v in vals:
        add("/v1/completions", {**base_c, k: v})
for k, vals in {
    "messages": [[], [{}], [{"role": "x", "content": "a"}], [{"role": "user"}], [{"role": "user", "content": None}],
                 [{"role": "user", "content": [{"type": "text", "text": "a"}]}], [{"role": "user", "content": [{"type": "image_url"}]}],
                 [{"role": "user", "content": 5}], "hi", [{"role": "assistant", "content": "a"}], [{"role": "tool", "content": "a"}],
                 [{"role": "system", "content": "s"}], [{"role": "user", "content": "a", "name": 5}],
                 [{"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [
                     {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{bad json"}}]},
                  {"role": "tool", "content": "r", "tool_call_id": 5}],
                 [{"role": "assistant", "content": None, "tool_calls": "x"}],
                 [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}]],
    "logprobs": [True, False, 1, "x"],
    "top_logprobs": [0, 20, 21, -1, 5],
    "n": [2, 0],
    "max_completion_tokens": [0, 5, -1],
    "tools": [[{"type": "function", "function": {"name": "f"}}], "x", [1], [{"type": "function"}],
              [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
              [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
                  "a": {"type": "string", "pattern": "(x"}}}}}], [{"function": {"name": "\ud800"}}]],
    "tool_choice": ["auto", "none", "x", "required", {"type": "function", "function": {"name": "f"}},
                    {"type": "function"}, {"function": {"name": 5}}, 5, []],
    "parallel_tool_calls": [True, False, "x"],
    "add_generation_prompt": [False],
    "continue_final_message": [True],
    "chat_template": ["{{ bogus", "{{ messages[0]['content'] }}", "{% for m in messages %}{{ m.content }}{% endfor %}"],
    "chat_template_kwargs": [{"a": 1}, "x", {"tokenize": True}, {"enable_thinking": False}, {"1": [1, {"x": None}]},
                             {"add_generation_prompt": False}, {"messages": []}],
    "stream": [True],
    "echo": [True],
}.items():
    for v in vals:
        add("/v1/chat/completions", {**base_ch, k: v})
# raw bodies
for raw in [b"", b"{", b"[]", b"null", b"1", b'"x"', b"{" * 100000, b'{"model":"' + b"a" * 10 + b'","prompt":"x","max_tokens":' + b"9" * 5000 + b"}",
            b'{"prompt":"a","max_tokens":NaN}', b'{"prompt":"a","temperature":Infinity}', b'{"prompt":"a","temperature":-Infinity}',
            b'{"prompt":"\\ud800","max_tokens":2}', b'\xff\xfe', b'{"prompt":"a","max_tokens":2,"max_tokens":3}',
            b'{"prompt":"a","bad\\nfield":1,"max_tokens":2}', b'{"prompt": "a", "max_tokens": 2e0}', b'{"prompt": "a", "max_tokens": 1e400}',
            b'{"prompt": [1,2,3], "max_tokens": 2, "echo": true, "logprobs": 2}',
            b'{"prompt": "a", "max_tokens": 2, "logit_bias": {"1": NaN}}']:
    add("/v1/completions", None, raw)
for path in ["/tokenize", "/detokenize"]:
    for body in [{}, {"prompt": "a"}, {"tokens": [1, 2]}, {"tokens": [-1]}, {"tokens": [10**12]}, {"tokens": "a"}, {"messages": [{"role": "user", "content": "a"}]},
                 {"prompt": "a", "add_special_tokens": "x"}, {"tokens": [1.5]}, {"prompt": None}, {"model": "x", "prompt": "a"}, {"messages": "x"}]:
        add(path, body)
combos = [
 (C, {"prompt": "a", "max_tokens": 3, "stream": True, "n": 2, "logprobs": 2}),
 (C, {"prompt": "a", "max_tokens": 0, "echo": True, "logprobs": 5}),
 (C, {"prompt": "a", "max_tokens": 0}),
 (C, {"prompt": "a b c " * 50, "max_tokens": 1, "prompt_logprobs": 5}),
 (C, {"prompt": "a", "max_tokens": 2, "logit_bias": {str(i): 1 for i in range(60000)}}),
 (C, {"prompt": "a", "max_tokens": 2, "best_of": 2, "stream": True}),
 (C, {"prompt": "a", "max_tokens": 2, "best_of": 3, "n": 2}),
 (C, {"prompt": "a", "max_tokens": 2, "best_of": 2, "n": 3}),
 (CH, {"messages": msgs, "max_tokens": 3, "logprobs": True, "top_logprobs": 5, "n": 2, "stream": True}),
 (CH, {"messages": msgs, "max_tokens": 3, "top_logprobs": 5}),
 (C, {"prompt": "a", "max_tokens": 2, "min_tokens": 5}),
 (C, {"prompt": "a", "max_tokens": 5, "stop": ["\n", " "], "include_stop_str_in_output": True}),
 (C, {"prompt": "a", "max_tokens": 3, "seed": 1, "n": 2, "temperature": 1}),
 (C, {"prompt": [49151], "max_tokens": 2}), (C, {"prompt": [49152], "max_tokens": 2}), (C, {"prompt": [0, 1, 2], "max_tokens": 2, "echo": True, "logprobs": 1}),
 (C, {"prompt": "a", "max_tokens": 8192}),
 (C, {"prompt": "a", "max_tokens": 2, "truncate_prompt_tokens": 1}), (C, {"prompt": "a", "max_tokens": 2, "truncate_prompt_tokens": -5}),
 (C, {"prompt": "a", "max_tokens": 2, "allowed_token_ids": []}), (C, {"prompt": "a", "max_tokens": 2, "allowed_token_ids": [-1]}),
 (C, {"prompt": "a", "max_tokens": 2, "allowed_token_ids": [5]}), (C, {"prompt": "a", "max_tokens": 2, "bad_words": ["x"]}),
 (C, {"prompt": "a", "max_tokens": 2, "spaces_between_special_tokens": False}),
 (C, {"prompt": "a", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
 (C, {"prompt": "a", "max_tokens": 3, "stream": False, "stream_options": {"include_usage": True}}),
 (C, {"prompt": "a", "max_tokens": 3, "temperature": 1e-30}), (C, {"prompt": "a", "max_tokens": 3, "temperature": 1e-6, "logprobs": 3}),
 (C, {"prompt": "a", "max_tokens": 3, "temperature": 100, "logprobs": 3}), (C, {"prompt": "a", "max_tokens": 3, "temperature": 3.4e38, "logprobs": 3}),
 (C, {"prompt": "a", "max_tokens": 3, "top_p": 1e-40, "temperature": 1}), (C, {"prompt": "a", "max_tokens": 3, "min_p": 1.0, "temperature": 1}),
 (C, {"prompt": "a", "max_tokens": 3, "top_k": 1, "temperature": 1, "logprobs": 5}),
 (C, {"prompt": "a", "max_tokens": 3, "repetition_penalty": 1e-30}), (C, {"prompt": "a", "max_tokens": 3, "repetition_penalty": 3e38, "logprobs": 2}),
 (C, {"prompt": "a", "max_tokens": 3, "presence_penalty": 2, "frequency_penalty": -2, "logprobs": 2}),
 (C, {"prompt": "a", "max_tokens": 3, "logit_bias": {"5": -100}, "allowed_token_ids": [5]}),
 (C, {"prompt": "a", "max_tokens": 3, "logit_bias": {"5": 100}, "logprobs": 5, "temperature": 1}),
 (C, {"prompt": ["a", [1, 2], "b"], "max_tokens": 2}),
 (C, {"prompt": "a", "max_tokens": 4, "response_format": {"type": "json_object"}, "n": 2}),
 (C, {"prompt": "a", "max_tokens": 4, "guided_json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, "stream": True}),
 (C, {"prompt": "a", "max_tokens": 4, "guided_regex": "[0-9]{3}", "logprobs": 3}),
 (C, {"prompt": "a", "max_tokens": 4, "guided_choice": ["yes", "no"], "n": 3, "temperature": 1}),
 (C, {"prompt": "a", "max_tokens": 4, "guided_grammar": "root ::= \"x\""}),
 (C, {"prompt": "a", "max_tokens": 4, "structured_outputs": {"json": {"type": "string"}}}),
 (CH, {"messages": msgs * 300, "max_tokens": 2}),
 (CH, {"messages": [{"role": "user", "content": ""}], "max_tokens": 2}),
 (CH, {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "max_tokens": 2, "continue_final_message": True, "add_generation_prompt": False}),
 (CH, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "continue_final_message": True}),
 (CH, {"messages": msgs, "max_tokens": 2, "echo": True, "logprobs": True, "top_logprobs": 2}),
 (CH, {"messages": msgs, "max_tokens": 2, "stop": "x", "stream": True, "n": 2}),
 (CH, {"messages": msgs, "max_tokens": 2, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}),
 (CH, {"messages": msgs, "max_tokens": 2, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], "tool_choice": "required"}),
 (CH, {"messages": msgs, "max_tokens": 2, "prompt_logprobs": 2}),
 (CH, {"messages": msgs, "max_tokens": 2, "prompt_logprobs": 2, "stream": True}),
 (C, {"prompt": "a", "max_tokens": 2, "prompt_logprobs": 2, "stream": True, "echo": True}),
 (C, {"prompt": "a", "max_tokens": 2, "n": 4, "best_of": 4, "logprobs": 2, "prompt_logprobs": 1, "temperature": 1, "seed": 3}),
 (C, {"prompt": "a b c d e f", "max_tokens": 3, "truncate_prompt_tokens": 2, "echo": True, "logprobs": 1}),
 (C, {"prompt": "a", "max_tokens": 3, "bad_words": ["a", "b"], "allowed_token_ids": [64], "stream": True}),
 (C, {"prompt": "a", "max_tokens": 3, "bad_words": ["x"], "guided_choice": ["x", "y"]}),
 (CH, {"messages": msgs, "max_tokens": 3, "bad_words": ["Hello"], "n": 2, "temperature": 1, "seed": 1}),
 (CH, {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "max_tokens": 2,
       "continue_final_message": True, "echo": True, "stream": True, "truncate_prompt_tokens": 3}),
 (C, {"prompt": "a", "max_tokens": 3, "n": 3, "use_beam_search": True, "stream": True, "echo": True}),
 (C, {"prompt": ["a", "b"], "max_tokens": 2, "n": 2, "use_beam_search": True, "length_penalty": 0}),
 (CH, {"messages": msgs, "max_tokens": 3, "n": 2, "use_beam_search": True, "logprobs": True}),
 (CH, {"messages": msgs, "max_tokens": 3, "n": 10, "use_beam_search": True, "stream": True,
       "stream_options": {"include_usage": True}}),
 (C, {"prompt": "a", "max_tokens": 2, "use_beam_search": True, "min_tokens": 2, "ignore_eos": True}),
]
for path, body in combos:
    cases.append((path, body, None))
bad = 0
for path, body, raw in cases:
    try:
        if raw is None:
            try:
                raw = json.dumps(body, allow_nan=False).encode()
            except ValueError:  # inf / NaN: not JSON; the raw cases send those literals
                continue
        if body is not None and body.get("stream") is True:
            with c.stream("POST", U + path, content=raw, headers={"content-type": "application/json"}) as r:
                txt = "".join(r.iter_text())
        else:
            r = c.post(U + path, content=raw, headers={"content-type": "application/json"})
            txt = r.text
    except httpx.HTTPError as e:
        bad += 1
        print("connection:", path, str(body if body is not None else raw)[:120], repr(e)[:160])
        continue
    if r.status_code >= 500:
        bad += 1
        print(r.status_code, path, str(body if body is not None else raw)[:120], txt[:200])
print(f"{len(cases)} bodies, {bad} answered 5xx or dropped; /health {c.get(U + '/health').status_code}")
sys.exit(1 if bad else 0)
