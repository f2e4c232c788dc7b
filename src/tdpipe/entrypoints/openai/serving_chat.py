"""POST /v1/chat/completions: messages through the model's chat template (add_generation_prompt=True) ->
a chat.completion object or its SSE stream of chat.completion.chunk deltas."""
from __future__ import annotations

from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tdpipe.core.engine_client import EngineClient
from tdpipe.entrypoints.openai.errors import bad_request
from tdpipe.entrypoints.openai.logprobs import chat_logprobs
from tdpipe.entrypoints.openai.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                                ChatCompletionResponse, ChatMessageOut, ChatStreamChoice,
                                                DeltaMessage)
from tdpipe.entrypoints.openai.serving import (Item, OpenAIServing, Prepared, Run, SSEResponse, StreamCursor,
                                               sse, sse_events)
from tdpipe.tokenizer import NoChatTemplate, chat_prompt


def apply_template(tok: Any, conv: list[dict[str, str]], add_generation_prompt: bool,
                   add_special_tokens: bool, continue_final_message: bool = False,
                   template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The conversation's prompt token ids; a template that rejects it (roles out of order...) is a 400."""
    try:
        text, ids = chat_prompt(tok, conv, add_generation_prompt=add_generation_prompt,
                                continue_final_message=continue_final_message, template_kwargs=template_kwargs)
    except NoChatTemplate as e:
        raise bad_request(str(e), "messages", "invalid_value") from None
    except Exception as e:  # noqa: BLE001 - jinja2 and the template's own raise_exception
        raise bad_request(f"the model's chat template rejected 'messages': {' '.join(str(e).split())}",
                          "messages", "invalid_value") from None
    return tok.encode(text, add_special_tokens=True) if add_special_tokens else ids


class ChatServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.s = serving

    def prepare(self, req: ChatCompletionRequest, eng: EngineClient, name: str, ignored: list[str], sp: Any,
                max_field: str) -> Prepared:
        """The conversation through the chat template, validated (on the tokenizer thread)."""
        self.s.check_grammar(req, sp)
        conv = req.conversation()
        add_generation_prompt, continue_final = req.template_flags()
        ids = apply_template(eng.tokenizer, conv, add_generation_prompt, req.add_special_tokens, continue_final,
                             req.template_kwargs())
        rid = self.s.new_id("chatcmpl")
        er = self.s.validated(rid, ids, sp, eng, "messages", max_field)
        so = req.stream_options
        return Prepared(rid, name, [Item(0, er, req.echoed(conv, add_generation_prompt))], req.stream,
                        include_usage=bool(so and so.include_usage),
                        continuous_usage=bool(so and so.continuous_usage_stats),
                        return_token_ids=req.return_token_ids, ignored=ignored)

    async def handle(self, req: ChatCompletionRequest, raw: Request) -> Response | None:
        eng = self.s.engine()
        name, ignored = self.s.common_checks(req, eng)
        max_tokens, max_field = req.output_limit()
        sp = self.s.sampling_params(req, max_tokens, max_field, eng)
        run = await self.s.admitted(eng, 1, lambda: self.prepare(req, eng, name, ignored, sp, max_field),
                                    "messages")
        prep = run.prep
        if prep.stream:
            return SSEResponse(sse_events(self._stream(prep, run)), on_close=run.close, headers=prep.headers())
        try:
            body = await self.s.until_disconnect(raw.receive, self._full(prep, run))
        finally:
            run.close()
        return None if body is None else JSONResponse(body, headers=prep.headers())

    async def _full(self, prep: Prepared, run: Run) -> dict:
        last = None
        async for _, out in run.outputs():
            last = out
        it = prep.items[0]
        tok = self.s.get_engine().tokenizer
        choices = []
        for c in last.outputs:
            choice = ChatChoice(index=c.index, message=ChatMessageOut(content=(it.prompt_text or "") + c.text),
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason)
            if it.params.logprobs is not None and c.logprobs is not None:
                choice.logprobs = chat_logprobs(tok, c.token_ids, c.logprobs, it.params.logprobs)
            if prep.return_token_ids:
                choice.prompt_token_ids, choice.token_ids = it.prompt_ids, list(c.token_ids)
            choices.append(choice)
        usage = self.s.usage(len(it.prompt_ids), sum(len(c.token_ids) for c in last.outputs),
                             last.num_cached_tokens)
        return ChatCompletionResponse(id=prep.request_id, created=prep.created, model=prep.model,
                                      choices=choices, usage=usage).model_dump()

    async def _stream(self, prep: Prepared, run: Run) -> AsyncIterator[bytes]:
        it = prep.items[0]
        n = it.params.n
        cur = StreamCursor(n)
        prompt_tokens = len(it.prompt_ids)
        tok = self.s.get_engine().tokenizer
        cached = 0  # the prompt tokens the prefix cache held (the outputs say so from the first token)

        def chunk(choices: list[ChatStreamChoice], usage: bool) -> ChatCompletionChunk:
            c = ChatCompletionChunk(id=prep.request_id, created=prep.created, model=prep.model,
                                    choices=choices)
            if usage:
                c.usage = self.s.usage(prompt_tokens, sum(cur.tokens), cached)
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
                step = cur.advance(c.index, c)
                if step is None:
                    continue
                choice = ChatStreamChoice(index=c.index,
                                          delta=DeltaMessage(content=step.text) if step.text else DeltaMessage(),
                                          finish_reason=c.finish_reason if step.finished else None)
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
