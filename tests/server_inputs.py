"""The server's bad-input matrix, shared by the fake-engine tests (unit/test_server_errors.py) and the real
server's (e2e/test_server_e2e.py): (route, body, status, param) cases that must fail naming param."""
from __future__ import annotations

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
    (C, {"prompt": "hi", "logit_bias": {"five": 10}}, 400, "logit_bias"),  # keys are token ids in decimal
    (C, {"prompt": "hi", "logit_bias": {"5": 500}}, 400, "logit_bias"),  # in [-100, 100]
    (CHAT, {"messages": U, "logit_bias": {"999999999": 1}}, 400, "logit_bias"),  # outside the vocabulary
    (C, {"prompt": "hi", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    (C, {"prompt": "hi", "allowed_token_ids": [999999999]}, 400, "allowed_token_ids"),
    (C, {"prompt": "hi", "bad_words": "word"}, 400, "bad_words"),  # a list of strings
    (C, {"prompt": "hi", "bad_words": ["ok", "  "]}, 400, "bad_words"),
    (CHAT, {"messages": U, "bad_words": ["w"] * 65}, 400, "bad_words"),  # at most 64
    (CHAT, {"messages": U, "chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs"),
    (CHAT, {"messages": U, "chat_template_kwargs": ["enable_thinking"]}, 400, "chat_template_kwargs"),
    ("/tokenize", {"messages": U, "chat_template_kwargs": {"add_generation_prompt": False}}, 400,
     "chat_template_kwargs"),
    (C, {"prompt": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    (C, {"prompt": "hi", "truncate_prompt_tokens": 10 ** 9}, 400, "truncate_prompt_tokens"),  # > max_model_len
    (C, {"prompt": "hi", "best_of": 0}, 400, "best_of"),
    (C, {"prompt": "hi", "n": 3, "best_of": 2}, 400, "best_of"),
    (C, {"prompt": "hi", "best_of": 9}, 400, "best_of"),
    (C, {"prompt": "hi", "best_of": 2, "stream": True}, 400, "best_of"),
    (C, {"prompt": "hi", "suffix": "end"}, 400, "suffix"),
    (C, {"prompt": "hi", "user": 5}, 400, "user"),
    (C, {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": U, "continue_final_message": True, "add_generation_prompt": True}, 400,
     "continue_final_message"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages[0].content[0]"),
    (CHAT, {"messages": U, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CHAT, {"messages": U, "tools": [{"type": "function", "function": {"name": ""}}]}, 400, "tools[0].function.name"),
    (CHAT, {"messages": U, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice.function.name"),
    (CHAT, {"messages": U, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    (CHAT, {"messages": U, "response_format": {"type": "json_schema"}}, 400, "response_format.json_schema.schema"),
    (CHAT, {"messages": U, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "nonsense"}}}}, 400, "response_format.json_schema.schema"),
    (CHAT, {"messages": U, "response_format": "json"}, 400, "response_format"),
    (C, {"prompt": "hi", "guided_regex": "(ab"}, 400, "guided_regex"),
    (C, {"prompt": "hi", "guided_choice": []}, 400, "guided_choice"),
    (C, {"prompt": "hi", "guided_grammar": "root ::= undefined_rule"}, 400, "guided_grammar"),
    (C, {"prompt": "hi", "guided_json": "{not json"}, 400, "guided_json"),
    (C, {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "structured_outputs"),
    (C, {"prompt": "hi", "structured_outputs": {"jsonn": {}}}, 400, "structured_outputs"),
    (C, {"prompt": "hi", "guided_regex": "a", "guided_choice": ["b"]}, 400, "guided_choice"),
    (CHAT, {"messages": U, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": U, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (CHAT, {"messages": U, "logprobs": 1}, 400, "logprobs"),
    (CHAT, {"messages": U, "n": 9}, 400, "n"),
    (CHAT, {"messages": U, "model": "other"}, 404, "model"),
    # hostile: floats that break in float32, caps on stops and prompts
    (C, {"prompt": "hi", "repetition_penalty": 1e-50}, 400, "repetition_penalty"),
    (C, {"prompt": "hi", "repetition_penalty": 1e-40}, 400, "repetition_penalty"),
    (C, {"prompt": "hi", "temperature": 1e39}, 400, "temperature"),
    (C, {"prompt": "hi", "top_p": 1e-50}, 400, "top_p"),
    (CHAT, {"messages": U, "frequency_penalty": 1e-50, "repetition_penalty": 1e300}, 400, "repetition_penalty"),
    (C, {"prompt": "hi", "stop": ["x"] * 65}, 400, "stop"),
    (C, {"prompt": "hi", "stop": "y" * 257}, 400, "stop"),
    (C, {"prompt": "hi", "stop_token_ids": [7] * 257}, 400, "stop_token_ids"),
    (C, {"prompt": ["a"] * 257}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": U}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
]
