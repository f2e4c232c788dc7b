"""POST /v1/completions: a prompt (text or token ids; a list of them is a batch, one choice each, as in
OpenAI and vLLM) -> a text_completion object or its SSE stream."""
from __future__ import annotations

from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tdpipe.core.engine_client import EngineClient
from tdpipe.entrypoints.openai.beam import beam_params
from tdpipe.entrypoints.openai.errors import bad_request
from tdpipe.entrypoints.openai.logprobs import completion_logprobs
from tdpipe.entrypoints.openai.protocol import (CompletionChoice, CompletionChunk, CompletionRequest,
                                                CompletionResponse)
from tdpipe.entrypoints.openai.serving import (Item, OpenAIServing, Prepared, Run, SSEResponse, StreamCursor,
                                               sse, sse_events)


class CompletionServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.s = serving

    def prepare(self, req: CompletionRequest, eng: EngineClient, name: str, ignored: list[str],
                prompts: list[str | list[int]], sp: Any) -> Prepared:
        """Tokenise and validate each prompt (on the tokenizer thread: megabytes of text take a while)."""
        self.s.check_grammar(req, sp)
        rid = self.s.new_id("cmpl")
        tok = eng.tokenizer
        items = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if not p:
                    raise bad_request("'prompt' must not be an empty string", "prompt", "invalid_value")
                ids, text = tok.encode(p, add_special_tokens=req.add_special_tokens), p
            else:
                ids, text = p, None
            er = self.s.validated(rid if len(prompts) == 1 else f"{rid}-{i}", ids, sp, eng, "prompt",
                                  "max_tokens", text)
            items.append(Item(i, er, text, beam_params(req, er.params)))
        if req.echo:
            for it in items:
                if it.prompt_text is None:
                    it.prompt_text = _decode(tok, it.prompt_ids)
        so = req.stream_options
        return Prepared(rid, name, items, req.stream, include_usage=bool(so and so.include_usage),
                        continuous_usage=bool(so and so.continuous_usage_stats),
                        return_token_ids=req.return_token_ids, ignored=ignored)

    async def handle(self, req: CompletionRequest, raw: Request) -> Response | None:
        eng = self.s.engine()
        name, ignored = self.s.common_checks(req, eng)
        prompts = req.prompts(self.s.config.max_prompts_per_request)
        # echo with max_tokens 0 runs the prompt for one token, which the answer leaves out (vLLM)
        echo_only = req.echo_only()
        sp = self.s.sampling_params(req, 1 if echo_only else req.max_tokens, "max_tokens", eng)
        text = req.echo or any(isinstance(p, str) for p in prompts)  # token ids alone need no tokenizer
        run = await self.s.admitted(eng, len(prompts), lambda: self.prepare(req, eng, name, ignored, prompts, sp),
                                    "prompt", tokenizer=text)
        prep, echo = run.prep, req.echo
        if prep.stream:
            return SSEResponse(sse_events(self._stream(prep, run, echo, echo_only)), on_close=run.close,
                               headers=prep.headers())
        try:
            body = await self.s.until_disconnect(raw.receive, self._full(prep, run, echo, echo_only))
        finally:
            run.close()
        return None if body is None else JSONResponse(body, headers=prep.headers())

    def _logprobs(self, prep: Prepared, it: Item, out: Any, c: Any, echo: bool,
                  generated: bool = True) -> dict | None:
        """The legacy logprobs object of choice c; with echo the prompt's positions first (vLLM), and only
        them where nothing was generated (echo with max_tokens 0)."""
        k = it.params.logprobs
        if k is None or c.logprobs is None:
            return None
        tok = self.s.get_engine().tokenizer
        ids, positions = (list(c.token_ids), list(c.logprobs)) if generated else ([], [])
        if echo and out.prompt_logprobs is not None:
            ids, positions = list(it.prompt_ids) + ids, list(out.prompt_logprobs) + positions
        return completion_logprobs(tok, ids, positions, k)

    async def _full(self, prep: Prepared, run: Run, echo: bool, echo_only: bool = False) -> dict:
        last: dict[int, Any] = {}
        async for i, out in run.outputs():
            last[i] = out
        choices = []
        completion_tokens = 0
        n = prep.items[0].params.n if prep.items else 1
        for it in prep.items:
            out = last[it.index]
            for c in out.outputs:
                ids = [] if echo_only else list(c.token_ids)
                completion_tokens += len(ids)
                text = (it.prompt_text or "") + ("" if echo_only else c.text) if echo else c.text
                choice = CompletionChoice(index=it.index * n + c.index, text=text,
                                          finish_reason="length" if echo_only else c.finish_reason,
                                          stop_reason=None if echo_only else c.stop_reason,
                                          logprobs=self._logprobs(prep, it, out, c, echo, not echo_only))
                if prep.return_token_ids:
                    choice.prompt_token_ids, choice.token_ids = it.prompt_ids, ids
                choices.append(choice)
        usage = self.s.usage(sum(len(it.prompt_ids) for it in prep.items), completion_tokens,
                             sum(out.num_cached_tokens for out in last.values()))
        return CompletionResponse(id=prep.request_id, created=prep.created, model=prep.model, choices=choices,
                                  usage=usage).model_dump()

    async def _stream(self, prep: Prepared, run: Run, echo: bool,
                      echo_only: bool = False) -> AsyncIterator[bytes]:
        n = prep.items[0].params.n if prep.items else 1
        cur = StreamCursor(len(prep.items) * n)  # prompt i's sample j is choice i * n + j (vLLM's numbering)
        prompt_tokens = sum(len(it.prompt_ids) for it in prep.items)
        tok = self.s.get_engine().tokenizer
        cached: dict[int, int] = {}  # per prompt, the tokens the prefix cache held (known from its first output)

        def chunk(choices: list[CompletionChoice], usage: bool) -> CompletionChunk:
            c = CompletionChunk(id=prep.request_id, created=prep.created, model=prep.model, choices=choices)
            if usage:
                c.usage = self.s.usage(prompt_tokens, sum(cur.tokens), sum(cached.values()))
            return c

        def echoed(it: Item, out: Any = None) -> list[CompletionChoice]:
            """The prompt back as each of its choices' first chunk, with the prompt's logprobs from `out`."""
            lp = None
            if out is not None and out.prompt_logprobs is not None:
                lp = completion_logprobs(tok, it.prompt_ids, out.prompt_logprobs, it.params.logprobs)
            return [CompletionChoice(index=it.index * n + j, text=it.prompt_text or "", logprobs=lp,
                                     finish_reason=None) for j in range(n)]

        # with logprobs the echo waits for the prompt's logprobs, which come with the first output
        scored = {it.index for it in prep.items if echo and it.params.logprobs is not None
                  and it.params.prompt_logprobs is not None}
        if echo and len(scored) < len(prep.items):
            yield sse(chunk([c for it in prep.items if it.index not in scored for c in echoed(it)], False))
        async for i, out in run.outputs():
            it = prep.items[i]
            cached[i] = out.num_cached_tokens
            if i in scored:
                scored.discard(i)
                yield sse(chunk(echoed(it, out), False))
            for c in out.outputs:
                k = i * n + c.index
                if echo_only:  # the one token run for the prompt's logprobs is not part of the answer
                    if c.finish_reason is not None and not cur.done[k]:
                        cur.done[k] = True
                        yield sse(chunk([CompletionChoice(index=k, text="", finish_reason="length")],
                                        prep.continuous_usage))
                    continue
                step = cur.advance(k, c)
                if step is None:
                    continue
                choice = CompletionChoice(index=k, text=step.text,
                                          finish_reason=c.finish_reason if step.finished else None)
                if step.finished:
                    choice.stop_reason = c.stop_reason
                if it.params.logprobs is not None and c.logprobs is not None:
                    offset = step.offset + (len(it.prompt_text or "") if echo else 0)
                    choice.logprobs = completion_logprobs(tok, c.token_ids[step.ids_from:],
                                                          c.logprobs[step.ids_from:], it.params.logprobs, offset)
                if prep.return_token_ids:  # the ids since this choice's last chunk; the prompt's once
                    choice.token_ids = list(c.token_ids[step.ids_from:])
                    if step.ids_from == 0:
                        choice.prompt_token_ids = it.prompt_ids
                yield sse(chunk([choice], prep.continuous_usage))
        if prep.include_usage:
            yield sse(chunk([], True))


def _decode(tok: Any, ids: list[int]) -> str:
    try:
        return tok.decode(ids)
    except Exception as e:  # noqa: BLE001 - ids outside the vocabulary
        raise bad_request(f"'prompt' has token ids the tokenizer cannot decode: {e}", "prompt",
                          "invalid_value") from None
