"""POST /v1/chat/completions: messages through the model's chat template (add_generation_prompt=True) ->
a chat.completion object or its SSE stream of chat.completion.chunk deltas; the request's tools through the
template and the answer's tool calls out of it (tool_calls.py)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tdpipe.core.engine_client import EngineClient
from tdpipe.core.validation import RequestError, check_grammar
from tdpipe.entrypoints.openai.beam import beam_params
from tdpipe.entrypoints.openai.errors import bad_request
from tdpipe.entrypoints.openai.logprobs import chat_logprobs
from tdpipe.entrypoints.openai.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                                ChatCompletionResponse, ChatMessageOut, ChatStreamChoice,
                                                DeltaMessage, renamed)
from tdpipe.entrypoints.openai.serving import (Item, OpenAIServing, Prepared, Run, SSEResponse, StreamCursor,
                                               sse, sse_events)
from tdpipe.entrypoints.conversation import template_conversation
from tdpipe.entrypoints.openai.reasoning import ReasoningStream, count_tokens, split
from tdpipe.entrypoints.openai.tool_calls import HermesStream, ToolPlan, parse_forced, parse_hermes, plan
from tdpipe.sampling.structured import StructuredOutputsParams
from tdpipe.tokenizer import NoChatTemplate, chat_prompt


def apply_template(tok: Any, conv: list[dict[str, Any]], add_generation_prompt: bool,
                   add_special_tokens: bool, continue_final_message: bool = False,
                   template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None
                   ) -> list[int]:
    """The conversation's prompt token ids; a template that rejects it (roles out of order...) is a 400."""
    try:
        text, ids = chat_prompt(tok, template_conversation(conv), add_generation_prompt=add_generation_prompt,
                                continue_final_message=continue_final_message, template_kwargs=template_kwargs,
                                tools=tools)
    except NoChatTemplate as e:
        raise bad_request(str(e), "messages", "invalid_value") from None
    except Exception as e:  # noqa: BLE001 - jinja2 and the template's own raise_exception
        raise bad_request(f"the model's chat template rejected 'messages': {' '.join(str(e).split())}",
                          "messages", "invalid_value") from None
    return tok.encode(text, add_special_tokens=True) if add_special_tokens else ids


@dataclass
class Shape:
    """How an answer's text becomes its message: the request's tools, and the reasoning parser (None: no
    reasoning field) with the template's enable_thinking and the request's include_reasoning."""

    tools: ToolPlan
    reasoning: str | None = None
    thinking: bool = True
    include_reasoning: bool = True


def message_of(shape: Shape, text: str, finish_reason: str | None) -> tuple[ChatMessageOut, str | None]:
    """A whole answer's message: its reasoning split off first (reasoning.py), the rest through answer()."""
    if shape.reasoning is None:
        return answer(shape.tools, text, finish_reason)
    reasoning, content = split(shape.reasoning, text, shape.thinking)
    message, finish = answer(shape.tools, content or "", finish_reason)
    if content is None and not message.tool_calls:
        message.content = None  # the answer ended inside its reasoning
    message.reasoning = reasoning if shape.include_reasoning else None
    return message, finish


def reasoning_tokens(shape: Shape, token_ids: list[Any], tokenizer: Any) -> int | None:
    """usage's reasoning_tokens over the choices' tokens: None (not shown) without a reasoning parser."""
    if shape.reasoning is None:
        return None
    return sum(count_tokens(shape.reasoning, list(t), tokenizer, shape.thinking) for t in token_ids)


def answer(tools: ToolPlan, text: str, finish_reason: str | None) -> tuple[ChatMessageOut, str | None]:
    """The message of a whole answer, and its finish reason: the text as content, or with tools its calls.
    The reason is "tool_calls" when the model called under "auto", or answered "required" to its end, and
    the model's own for a named call (OpenAI's rule, which vLLM follows)."""
    if tools.mode == "auto":
        content, calls = parse_hermes(text)
        calls = calls[:1] if tools.single else calls
        return ChatMessageOut(content=content, tool_calls=calls), ("tool_calls" if calls else finish_reason)
    if tools.mode in ("named", "required"):
        calls = parse_forced(tools, text)
        return ChatMessageOut(content="" if calls else text, tool_calls=calls), forced_reason(tools, finish_reason)
    return ChatMessageOut(content=text), finish_reason


def forced_reason(tools: ToolPlan, finish_reason: str | None) -> str | None:
    return "tool_calls" if tools.mode == "required" and finish_reason == "stop" else finish_reason


class StreamedChoice:
    """One streamed choice: its reasoning split off as it comes (reasoning.py), the rest through
    StreamedCalls."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.reasoning = ReasoningStream(shape.reasoning, shape.thinking) if shape.reasoning else None
        self.calls = StreamedCalls(shape.tools)

    def delta(self, text: str, finished: bool, finish_reason: str | None) -> tuple[DeltaMessage, str | None]:
        if self.reasoning is None:
            return self.calls.delta(text, finished, finish_reason)
        thought, text = self.reasoning.feed(text)
        if finished:
            thought += self.reasoning.finish()
        delta, finish = self.calls.delta(text, finished, finish_reason)
        if thought and self.shape.include_reasoning:
            delta.reasoning = thought
        return delta, finish


class StreamedCalls:
    """One streamed choice's tool calls: under "auto" its text goes through the hermes stream parser (content
    until a call begins, each call whole once it closes); a forced call is sent whole when the answer ends.
    Each call delta carries its index among the choice's calls, as OpenAI's stream does."""

    def __init__(self, tools: ToolPlan) -> None:
        self.tools = tools
        self.parser = HermesStream() if tools.mode == "auto" else None
        self.forced = ""  # a forced call's text so far
        self.sent = 0

    def delta(self, text: str, finished: bool, finish_reason: str | None) -> tuple[DeltaMessage, str | None]:
        if self.tools.mode == "none":
            return (DeltaMessage(content=text) if text else DeltaMessage()), (finish_reason if finished else None)
        content, calls = "", []
        if self.parser is not None:
            content, calls = self.parser.feed(text)
            if finished:
                content += self.parser.finish()
        else:
            self.forced += text
            if finished:
                calls = parse_forced(self.tools, self.forced)
                content = "" if calls else self.forced
        if self.tools.single:  # parallel_tool_calls false: the first call only
            calls = calls[:max(0, 1 - self.sent)]
        out = [{"index": self.sent + k, **c} for k, c in enumerate(calls)]
        self.sent += len(calls)
        delta = DeltaMessage(content=content or None, tool_calls=out or None)
        if not finished:
            return delta, None
        if self.parser is None:
            return delta, forced_reason(self.tools, finish_reason)
        return delta, ("tool_calls" if self.parser.calls else finish_reason)


class ChatServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.s = serving

    def tool_plan(self, req: ChatCompletionRequest) -> ToolPlan:
        cfg = self.s.config
        return plan(req.tools, req.tool_choice, cfg.enable_auto_tool_choice, cfg.tool_call_parser,
                    req.parallel_tool_calls)

    def shape(self, req: ChatCompletionRequest, tools: ToolPlan, sp: Any) -> Shape:
        """`sp`: the request's sampling parameters with the tools' constraint in (constrain()): an output
        held to a grammar (a forced call, structured output) has no reasoning before it."""
        thinking = (req.chat_template_kwargs or {}).get("enable_thinking", True) is not False
        return Shape(tools, self.s.config.reasoning_parser, thinking and sp.structured_outputs is None,
                     req.include_reasoning)

    @staticmethod
    def constrain(req: ChatCompletionRequest, sp: Any, tools: ToolPlan) -> Any:
        """tool_choice "required" or a named function: the output held to their JSON schema (structured
        output, as vLLM does), which excludes the request's own constraint."""
        if tools.schema is None:
            return sp
        if sp.structured_outputs is not None:
            raise bad_request(f"tool_choice {req.tool_choice!r} constrains the output itself: drop the request's "
                              "response_format / structured_outputs / guided_* field", "tool_choice",
                              "invalid_value")
        return replace(sp, structured_outputs=StructuredOutputsParams(json=tools.schema))

    @staticmethod
    def _check_tool_grammar(sp: Any) -> None:
        """A forced call's schema compiled (a tool's parameters may be a schema xgrammar refuses): a 400 naming
        the tools."""
        try:
            check_grammar(sp)
        except RequestError as e:
            raise bad_request(renamed(str(e), "json", "the tool's parameters schema"), "tools", e.code) from None

    def prepare(self, req: ChatCompletionRequest, eng: EngineClient, name: str, ignored: list[str], sp: Any,
                max_field: str, tools: ToolPlan) -> Prepared:
        """The conversation through the chat template, validated (on the tokenizer thread)."""
        if tools.schema is None:
            self.s.check_grammar(req, sp)
        else:
            self._check_tool_grammar(sp)
        conv = req.conversation()
        add_generation_prompt, continue_final = req.template_flags()
        ids = apply_template(eng.tokenizer, conv, add_generation_prompt, req.add_special_tokens, continue_final,
                             req.template_kwargs(), tools.tools)
        rid = self.s.new_id("chatcmpl")
        er = self.s.validated(rid, ids, sp, eng, "messages", max_field)
        so = req.stream_options
        item = Item(0, er, req.echoed(conv, add_generation_prompt), beam_params(req, er.params))
        return Prepared(rid, name, [item], req.stream,
                        include_usage=bool(so and so.include_usage),
                        continuous_usage=bool(so and so.continuous_usage_stats),
                        return_token_ids=req.return_token_ids, ignored=ignored)

    async def handle(self, req: ChatCompletionRequest, raw: Request) -> Response | None:
        eng = self.s.engine()
        name, ignored = self.s.common_checks(req, eng)
        max_tokens, max_field = req.output_limit()
        tools = self.tool_plan(req)
        sp = self.constrain(req, self.s.sampling_params(req, max_tokens, max_field, eng), tools)
        shape = self.shape(req, tools, sp)
        run = await self.s.admitted(eng, 1, lambda: self.prepare(req, eng, name, ignored, sp, max_field,
                                                                 shape.tools), "messages")
        prep = run.prep
        if prep.stream:
            return SSEResponse(sse_events(self._stream(prep, run, shape)), on_close=run.close,
                               headers=prep.headers())
        try:
            body = await self.s.until_disconnect(raw.receive, self._full(prep, run, shape))
        finally:
            run.close()
        return None if body is None else JSONResponse(body, headers=prep.headers())

    async def _full(self, prep: Prepared, run: Run, shape: Shape) -> dict:
        last = None
        async for _, out in run.outputs():
            last = out
        it = prep.items[0]
        tok = self.s.get_engine().tokenizer
        choices = []
        for c in last.outputs:
            message, finish = message_of(shape, (it.prompt_text or "") + c.text, c.finish_reason)
            choice = ChatChoice(index=c.index, message=message, finish_reason=finish, stop_reason=c.stop_reason)
            if it.params.logprobs is not None and c.logprobs is not None:
                choice.logprobs = chat_logprobs(tok, c.token_ids, c.logprobs, it.params.logprobs)
            if prep.return_token_ids:
                choice.prompt_token_ids, choice.token_ids = it.prompt_ids, list(c.token_ids)
            choices.append(choice)
        usage = self.s.usage(len(it.prompt_ids), sum(len(c.token_ids) for c in last.outputs),
                             last.num_cached_tokens, reasoning_tokens(shape, [c.token_ids for c in last.outputs], tok))
        return ChatCompletionResponse(id=prep.request_id, created=prep.created, model=prep.model,
                                      choices=choices, usage=usage).model_dump()

    async def _stream(self, prep: Prepared, run: Run, shape: Shape) -> AsyncIterator[bytes]:
        it = prep.items[0]
        n = it.params.n
        cur = StreamCursor(n)
        calls = [StreamedChoice(shape) for _ in range(n)]
        prompt_tokens = len(it.prompt_ids)
        tok = self.s.get_engine().tokenizer
        cached = 0  # the prompt tokens the prefix cache held (the outputs say so from the first token)
        ids: list[list[int]] = [[] for _ in range(n)]  # each choice's tokens so far (its reasoning is counted)

        def chunk(choices: list[ChatStreamChoice], usage: bool) -> ChatCompletionChunk:
            c = ChatCompletionChunk(id=prep.request_id, created=prep.created, model=prep.model,
                                    choices=choices)
            if usage:
                c.usage = self.s.usage(prompt_tokens, sum(cur.tokens), cached, reasoning_tokens(shape, ids, tok))
            return c

        # the role first, as OpenAI does: a client sees each answer begin before its first token
        for j in range(n):
            yield sse(chunk([ChatStreamChoice(index=j, delta=DeltaMessage(role="assistant", content=""),
                                              logprobs=None, finish_reason=None)], prep.continuous_usage))
            if it.prompt_text:  # echo: the last message's text, before the generated tokens (vLLM)
                yield sse(chunk([ChatStreamChoice(index=j, delta=DeltaMessage(content=it.prompt_text),
                                                  logprobs=None, finish_reason=None)], prep.continuous_usage))
        async for _, out in run.outputs():
            cached = out.num_cached_tokens
            for c in out.outputs:
                ids[c.index] = c.token_ids
                step = cur.advance(c.index, c)
                if step is None:
                    continue
                delta, finish = calls[c.index].delta(step.text, step.finished, c.finish_reason)
                choice = ChatStreamChoice(index=c.index, delta=delta, finish_reason=finish)
                if step.finished:
                    choice.stop_reason = c.stop_reason
                if it.params.logprobs is not None and c.logprobs is not None:
                    choice.logprobs = chat_logprobs(tok, c.token_ids[step.ids_from:], c.logprobs[step.ids_from:],
                                                    it.params.logprobs)
                if prep.return_token_ids:  # the ids since the last chunk; the prompt's with the first
                    choice.token_ids = list(c.token_ids[step.ids_from:])
                    if step.ids_from == 0:
                        choice.prompt_token_ids = it.prompt_ids
                yield sse(chunk([choice], prep.continuous_usage))
        if prep.include_usage:
            yield sse(chunk([], True))
