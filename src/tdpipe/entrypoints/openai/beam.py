"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions: `n` beams, the best `n` sequences
returned as the choices (sampling/beam_search.py runs the search; each step is one engine request per live
beam, asking for one token and its 2 x n most likely alternatives, prefix caching keeping the shared
prefixes). As in vLLM the answer comes whole (a stream sends it as one chunk per choice), stops on EOS or
max_tokens, and is ranked by cumulative logprob over length ** length_penalty."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Any, AsyncIterator

from tdpipe.core.engine_client import EngineClient
from tdpipe.core.validation import EngineRequest
from tdpipe.entrypoints.openai.errors import OpenAIError, bad_request
from tdpipe.outputs import CompletionOutput, Logprob, RequestOutput
from tdpipe.sampling.beam_search import BeamSearchParams, beam_search_async
from tdpipe.sampling.params import MAX_LOGPROBS, SamplingParams

# request fields a beam search does not honour: a 400 naming them rather than an answer that ignores them
_REFUSED = ("best_of", "logprobs", "top_logprobs", "prompt_logprobs", "stop", "response_format",
            "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "tools")


def beam_params(req: Any, sp: SamplingParams) -> BeamSearchParams | None:
    """The request's beam search (None without use_beam_search): beam width n, max_tokens (`sp` is the
    validated request's: resolved to what fits), ignore_eos, length_penalty, temperature (0 unless sent)."""
    if not req.use_beam_search:
        return None
    for name in _REFUSED:
        if getattr(req, name, None) not in (None, [], "", False):
            raise bad_request(f"use_beam_search cannot go with '{name}' (beams stop on EOS or max_tokens, with "
                              "no constraint or logprobs)", name, "invalid_value")
    if 2 * sp.n > MAX_LOGPROBS:
        raise bad_request(f"use_beam_search: n is the beam width, at most {MAX_LOGPROBS // 2} (each step asks "
                          f"for the 2 x n most likely tokens), got {sp.n}", "n", "invalid_value")
    return BeamSearchParams(beam_width=sp.n, max_tokens=sp.max_tokens, ignore_eos=sp.ignore_eos,
                            temperature=req.temperature if req.temperature is not None else 0.0,
                            length_penalty=float(req.length_penalty),
                            include_stop_str_in_output=sp.include_stop_str_in_output)


async def beam_outputs(eng: EngineClient, r: EngineRequest, params: BeamSearchParams) -> AsyncIterator[RequestOutput]:
    """The search for the validated request `r` over the engine client; one RequestOutput (finished) with a
    choice per beam, best first. Leaving early (a client gone) cancels the step's requests, which aborts them
    in the engine."""
    request_id, prompt_ids = r.request_id, r.prompt_token_ids
    step_params = params.step_params()

    async def one(tokens: list[int], k: int) -> dict[int, Logprob]:
        last = None
        async with contextlib.aclosing(eng.generate(tokens, step_params, f"{request_id}-beam{k}")) as gen:
            async for out in gen:
                last = out
        c = last.outputs[0] if last is not None else None
        if c is None or c.finish_reason not in ("stop", "length") or not c.logprobs:
            raise OpenAIError(503, "a beam search step ended without an answer", code="request_aborted")
        return c.logprobs[0]

    counter = itertools.count()

    async def step(batch: list[list[int]]) -> list[dict[int, Logprob]]:
        return list(await asyncio.gather(*(one(t, next(counter)) for t in batch)))

    [found] = await beam_search_async([prompt_ids], params, step, eng.eos_token_ids, eng.max_model_len)
    n0, tok = len(prompt_ids), eng.tokenizer
    outs = []
    for j, b in enumerate(found.sequences):
        ids = b.tokens[n0:]
        if b.finish_reason == "stop" and not params.include_stop_str_in_output:
            ids = ids[:-1]  # the EOS that ended it (vLLM's output)
        text = tok.decode(ids, skip_special_tokens=r.params.skip_special_tokens) if tok is not None else ""
        outs.append(CompletionOutput(j, text, ids, b.finish_reason, b.stop_reason, b.cum_logprob))
    yield RequestOutput(request_id, r.prompt, prompt_ids, outs, finished=True)


__all__ = ["beam_outputs", "beam_params"]
