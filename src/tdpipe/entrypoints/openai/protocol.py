"""The OpenAI API's request and response bodies, with OpenAI's field names (and vLLM's extra sampling fields).

Requests are validated strictly: "max_tokens": "10" or "stream": 1 is a 400 naming the field, never a silent
coercion. Unknown top-level fields are ignored and named in the answer (ignored_fields.py; vLLM's
behaviour: clients send newer fields), except the ones in UNSUPPORTED, which would change the result if
ignored (suffix, functions...): those are a 400 unless they hold their neutral value.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Iterator, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_serializer

from tdpipe.entrypoints.conversation import ROLES
from tdpipe.entrypoints.openai.errors import bad_request, from_validation_error
from tdpipe.sampling.structured import StructuredOutputsParams
from tdpipe.tokenizer import check_template_kwargs


class _Request(BaseModel):
    """Strict types (JSON true is a bool, 1 is not); unknown fields kept in model_extra for the checks
    below."""

    model_config = ConfigDict(strict=True, extra="allow")

    def unknown_fields(self) -> list[str]:
        """Unknown fields that are safe to ignore (the caller logs them); raises for those that are not."""
        extra = self.model_extra or {}
        for name, value in extra.items():
            neutral = UNSUPPORTED.get(name)
            if neutral is not None and not neutral(value):
                raise bad_request(f"'{name}' is not supported by this server; "
                                  "remove it or send its default", name, "unsupported_parameter")
        return sorted(k for k in extra if k not in UNSUPPORTED)


def _none_or_empty(v: Any) -> bool:
    return v is None or v in ({}, [], "")


def _is(*ok: Any) -> Callable[[Any], bool]:
    return lambda v: any(v is o or (type(v) is type(o) and v == o) for o in ok)


# field -> "this value changes nothing": any other value is a 400 (it would silently change results)
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "suffix": _none_or_empty,
    "logits_processors": _none_or_empty,
    "functions": _none_or_empty,  # the legacy names of tools and tool_choice
    "function_call": _is(None, "none", "auto"),
    "chat_template": _is(None),
    "documents": _none_or_empty,
    "audio": _is(None),
    "prediction": _is(None),
    "modalities": lambda v: v is None or v == ["text"],
}


def renamed(message: str, kind: str, field: str) -> str:
    """A StructuredOutputsParams message ('structured_outputs.json is not ...') naming the request's field."""
    return message.replace(f"structured_outputs.{kind}", field, 1)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class _GenerationRequest(_Request):
    """What completions and chat share: the sampling fields. None means the default (OpenAI sends null)."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    best_of: int | None = None  # vLLM: sample best_of, return the n with the highest cumulative logprob
    prompt_logprobs: int | None = None  # vLLM: the prompt tokens' logprobs (top k)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: Any = None  # str | list[str]; SamplingParams checks it (one clear message for both shapes)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # accepted, ignored (OpenAI uses it for abuse monitoring)
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    return_token_ids: bool = False  # vLLM: prompt_token_ids and token_ids in each choice
    logit_bias: dict[str, float] | None = None  # OpenAI's: {"token id": bias in [-100, 100]}
    allowed_token_ids: list[int] | None = None  # vLLM's: the only tokens the answer may hold
    bad_words: list[str] | None = None  # vLLM's: words the answer must not contain
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens (-1: all that fit)
    use_beam_search: bool = False  # vLLM's: n beams, the n best returned (entrypoints/openai/beam.py)
    length_penalty: float = 1.0  # vLLM's: beams ranked by cumulative logprob / length ** length_penalty
    # structured output: OpenAI's response_format, vLLM's structured_outputs, and vLLM's older guided_* names
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    GUIDED: ClassVar[dict[str, str]] = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                                        "guided_grammar": "grammar"}

    def sampling_kwargs(self) -> dict[str, Any]:
        """The fields SamplingParams takes, None dropped (its defaults apply: declared once, there)."""
        names = ("n", "best_of", "prompt_logprobs", "temperature", "top_p", "seed", "stop", "presence_penalty",
                 "frequency_penalty",
                 "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
                 "skip_special_tokens", "include_stop_str_in_output", "allowed_token_ids", "bad_words",
                 "truncate_prompt_tokens")
        kw = {k: getattr(self, k) for k in names if getattr(self, k) is not None}
        if self.logit_bias:  # JSON keys are strings: token ids in decimal
            bad = next((k for k in self.logit_bias if not k.isascii() or not k.isdigit()), None)
            if bad is not None:
                raise bad_request(f"logit_bias keys must be token ids in decimal, got {bad!r}", "logit_bias",
                                  "invalid_value")
            kw["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
        return kw

    def structured(self) -> tuple[StructuredOutputsParams | None, str]:
        """The output constraint, and the field it came from (the prefix of its errors): at most one of
        response_format (json_object, json_schema), structured_outputs and the guided_* fields."""
        given = [f for f in ("response_format", "structured_outputs", *self.GUIDED) if getattr(self, f) is not None]
        rf = self.response_format
        if rf is not None and rf.get("type") == "text":
            given.remove("response_format")
        if not given:
            return None, ""
        if len(given) > 1:
            raise bad_request(f"set at most one of {', '.join(given)}: each constrains the output on its own",
                              given[1], "invalid_value")
        field = given[0]
        if field == "response_format":
            return self._response_format(rf)
        try:
            if field == "structured_outputs":
                so = StructuredOutputsParams.of(self.structured_outputs)
                return so, f"structured_outputs.{so.kind}"
            kind = self.GUIDED[field]
            return StructuredOutputsParams(**{kind: getattr(self, field)}), field
        except ValueError as e:
            msg = str(e) if field == "structured_outputs" else renamed(str(e), self.GUIDED[field], field)
            raise bad_request(msg, field, "invalid_value") from None

    @staticmethod
    def _response_format(rf: dict[str, Any]) -> tuple[StructuredOutputsParams, str]:
        kind = rf.get("type")
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True), "response_format"
        if kind != "json_schema":
            raise bad_request(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got "
                              f"{str(kind)[:60]!r}", "response_format.type", "invalid_value")
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request("'response_format.json_schema.schema' must be a JSON schema (an object) when "
                              "'response_format.type' is 'json_schema'", "response_format.json_schema.schema",
                              "invalid_value")
        return StructuredOutputsParams(json=schema), "response_format.json_schema.schema"

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")


class CompletionRequest(_GenerationRequest):
    prompt: Any  # str | list[str] | list[int] | list[list[int]], checked by prompts() for a clear message
    max_tokens: int | None = 16  # OpenAI's default for completions; null = up to max_model_len
    echo: bool = False
    add_special_tokens: bool = True  # vLLM: BOS etc. when tokenising a text prompt
    logprobs: int | None = None  # legacy completions: the top k per token (0-20)
    LOGPROBS_FIELD: ClassVar[str] = "logprobs"

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt back (with its logprobs), nothing generated. OpenAI's way to
        score a text, and vLLM's; evaluation harnesses send it."""
        return self.echo and self.max_tokens == 0

    def sampling_kwargs(self) -> dict[str, Any]:
        """With echo, the prompt's own logprobs come with `logprobs` unless prompt_logprobs says otherwise
        (vLLM): the echoed text's positions are scored too, as OpenAI's legacy completions did."""
        kw = super().sampling_kwargs()
        if self.echo and self.logprobs is not None and self.prompt_logprobs is None:
            kw["prompt_logprobs"] = self.logprobs
        return kw

    def prompts(self, max_prompts: int) -> list[str | list[int]]:
        """The prompt as a batch: one entry per choice (OpenAI: a list of prompts is a batch), at most
        `max_prompts` of them. Only the shape is checked here, in time proportional to the number of prompts;
        the token ids themselves are checked with the rest of the prompt, off the event loop."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p, list) and not p:
            raise bad_request("'prompt' must not be empty", "prompt", "invalid_value")
        if isinstance(p, list):
            if type(p[0]) is int:  # one prompt of token ids
                return [p]
            if len(p) > max_prompts:
                raise bad_request(f"'prompt' has {len(p)} prompts; at most {max_prompts} are allowed in one "
                                  "request (--max-prompts-per-request)", "prompt", "invalid_value")
            if all(isinstance(x, str) for x in p):
                return list(p)
            if all(isinstance(x, list) for x in p):
                return list(p)
        raise bad_request("'prompt' must be a string, a list of strings, a list of token ids (integers >= 0) "
                          "or a list of such lists", "prompt", "invalid_type")


class ChatMessage(_Request):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # an assistant's earlier calls (entrypoints/openai/tool_calls.py)
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self, where: str) -> str:
        """The content as one string: a list of {"type": "text", "text": ...} parts is joined (images and
        audio are not supported). An assistant message that only calls tools has none: ""."""
        c = self.content
        if isinstance(c, str):
            return c
        if c is None:
            if self.tool_calls:
                return ""
            raise bad_request(f"'{where}.content' is required", f"{where}.content", "invalid_value")
        parts = []
        for j, part in enumerate(c):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"'{where}.content[{j}]': only text parts ({{\"type\": \"text\", \"text\": "
                                  f"...}}) are supported, got type {part.get('type')!r}",
                                  f"{where}.content[{j}]", "invalid_value")
            parts.append(part["text"])
        return "".join(parts)


def _checked_calls(calls: list[Any], where: str) -> list[dict[str, Any]]:
    """An assistant message's tool_calls: each {"id"?, "type": "function", "function": {"name", "arguments"}}
    (arguments a JSON string, or an object); a 400 naming the bad one."""
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                not isinstance(fn.get("arguments", "{}"), str | dict):
            raise bad_request(f"'{where}[{j}]' must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                              "\"arguments\": ...}}", f"{where}[{j}]", "invalid_value")
    return calls


def chat_messages(raw: list[Any]) -> Iterator[ChatMessage]:
    """Each message validated as a ChatMessage, one at a time: `messages` is only checked to be a list
    when the body is parsed (on the event loop), so a body of 100,000 messages is validated here, off it,
    with the loop free between messages. A generator, so that each model is dropped once its caller has read
    it: 100,000 live models would be 200,000 objects for the garbage collector, whose full collections
    (0.2-0.7 s here) hold the interpreter lock and so freeze the event loop too. A bad message is a 400 naming
    it (messages[2].role)."""
    for i, m in enumerate(raw):
        try:
            yield m if isinstance(m, ChatMessage) else ChatMessage.model_validate(m)
        except ValidationError as e:
            raise from_validation_error(e, ("messages", i)) from None


class _ChatTemplateFlags(_Request):
    """How a request with messages (chat, /tokenize) ends its chat template."""

    add_generation_prompt: bool = True  # vLLM: end the template with the assistant's turn header
    continue_final_message: bool = False  # vLLM: leave the last message open, to be continued (a prefill)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM: variables for the template (enable_thinking)

    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs, checked (tokenizer.check_template_kwargs): a 400 naming the field."""
        try:
            return check_template_kwargs(self.chat_template_kwargs)
        except ValueError as e:
            raise bad_request(str(e), "chat_template_kwargs", "invalid_value") from None

    def template_flags(self) -> tuple[bool, bool]:
        """(add_generation_prompt, continue_final_message): continuing the last message means no new turn,
        so add_generation_prompt is off unless the client sent it true too, which is a 400 (vLLM)."""
        if not self.continue_final_message:
            return self.add_generation_prompt, False
        if self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
            raise bad_request("'continue_final_message' and 'add_generation_prompt' cannot both be true: the "
                              "first continues the last message, the second opens a new one",
                              "continue_final_message", "invalid_value")
        return False, True


class ChatCompletionRequest(_GenerationRequest, _ChatTemplateFlags):
    messages: list[Any]  # ChatMessage each, checked by conversation() (chat_messages)
    tools: list[Any] | None = None  # checked by tool_calls.plan, with tool_choice
    tool_choice: Any = None  # none | auto (the default with tools) | required | {"type": "function", ...}
    parallel_tool_calls: bool | None = None  # false: the first call only (vLLM's rule)
    include_reasoning: bool = True  # vLLM's: false drops the reasoning (with --reasoning-parser)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens; both work
    max_completion_tokens: int | None = None
    add_special_tokens: bool = False  # vLLM: the template already has them
    logprobs: bool | None = None
    top_logprobs: int | None = None  # 0-20, with logprobs: true
    echo: bool = False  # vLLM: the answer starts with the last message when it has the answer's role
    LOGPROBS_FIELD: ClassVar[str] = "top_logprobs"

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, str]]:
        """[{"role", "content"}] for the chat template; roles and contents checked, naming the message."""
        if not self.messages:
            raise bad_request("'messages' must contain at least one message", "messages", "invalid_value")
        conv = []
        for i, m in enumerate(chat_messages(self.messages)):
            where = f"messages[{i}]"
            if m.role not in ROLES:
                raise bad_request(f"'{where}.role': unknown role {m.role!r} (expected one of "
                                  f"{', '.join(ROLES)})", f"{where}.role", "invalid_value")
            msg: dict[str, Any] = {"role": m.role, "content": m.text(where)}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_calls:
                msg["tool_calls"] = _checked_calls(m.tool_calls, f"{where}.tool_calls")
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            conv.append(msg)
        return conv

    def echoed(self, conv: list[dict[str, str]], add_generation_prompt: bool) -> str | None:
        """With echo, the text the answer starts with (vLLM): the last message's content when it has the
        answer's role, which is the assistant's with a generation prompt and the last message's own without
        (continue_final_message); None without echo."""
        if not self.echo:
            return None
        last = conv[-1]
        return last["content"] if not add_generation_prompt or last["role"] == "assistant" else ""

    def output_limit(self) -> tuple[int | None, str]:
        """max_completion_tokens, else max_tokens, and the field it came from (for error messages)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class TokenizeRequest(_ChatTemplateFlags):
    """{"prompt": text} or {"messages": [...]} (chat template applied)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None  # ChatMessage each, checked with the template, off the event loop
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages


class UpdateWeightsRequest(_Request):
    """POST /update_weights_from_disk (SGLang's route and field): a checkpoint folder the server can read;
    `in_flight`: "finish" (requests in flight complete on the old weights) or "recompute" (they are paused
    and recomputed on the new ones: core/engine_core.py IN_FLIGHT_MODES)."""

    model_path: str
    in_flight: Literal["finish", "recompute"] = "finish"


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# -- responses -------------------------------------------------------------------------------------------
class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None  # {"cached_tokens": n}, when the server shows it
    completion_tokens_details: dict[str, int] | None = None  # {"reasoning_tokens": n}, with a reasoning parser

    @model_serializer(mode="wrap")
    def _details_if_shown(self, handler: Any) -> dict[str, Any]:
        d = handler(self)
        for k in ("prompt_tokens_details", "completion_tokens_details"):
            if d.get(k) is None:
                d.pop(k, None)
        return d


class _Choice(BaseModel):
    """token_ids and prompt_token_ids appear only when the request asked for them (return_token_ids)."""

    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None

    @model_serializer(mode="wrap")
    def _ids_if_asked(self, handler: Any) -> dict[str, Any]:
        d = handler(self)
        for k in ("prompt_token_ids", "token_ids"):
            if d.get(k) is None:
                d.pop(k, None)
        return d


class CompletionChoice(_Choice):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: Literal["stop", "length"] | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or token id that ended it (None for EOS)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning: str | None = None  # with --reasoning-parser (vLLM's field); left out otherwise
    tool_calls: list[dict[str, Any]] | None = None  # left out when the answer calls no tool

    @model_serializer(mode="wrap")
    def _no_empty_extras(self, handler: Any) -> dict[str, Any]:
        d = handler(self)
        if not d.get("tool_calls"):
            d.pop("tool_calls", None)
        if d.get("reasoning") is None:
            d.pop("reasoning", None)
        return d


class ChatChoice(_Choice):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaMessage(BaseModel):
    """Only what changed: {"role": "assistant", "content": ""} first, then {"content": ...}, {} at the end."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None  # with --reasoning-parser
    tool_calls: list[dict[str, Any]] | None = None  # each {"index", "id", "type", "function"}

    @model_serializer(mode="wrap")
    def _changed_only(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(_Choice):
    index: int
    delta: DeltaMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tdpipe"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str
