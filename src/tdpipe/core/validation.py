"""Request validation, in one place, in the frontend: `AsyncLLM` calls `validate_request` for a raw prompt;
the OpenAI server calls its two halves itself, early, so a bad request is a 400 before any stream starts:
`check_params` once per request, `validate_prompt` per prompt of a batch. What passes becomes an
`EngineRequest` that runs as it is. `LLMEngine.add_request` keeps one defensive check of its own for direct
users.

Beyond SamplingParams' own checks (types, documented ranges), this module bounds what a client could use to
hurt the server: the count and length of stop strings and stop token ids (scanned every token), and floats
that are valid as float64 but break where they are used, in float32 logits (repetition_penalty=1e-50 is 0.0
in float32: the sampler would divide logits by zero).
"""
from __future__ import annotations

import dataclasses
import math
import re
import struct
from dataclasses import dataclass
from typing import Any

from tdpipe.sampling.grammar import parse_grammar
from tdpipe.sampling.params import SamplingParams

__all__ = ["EngineRequest", "RequestError", "RequestLimits", "MAX_STOP_STRINGS", "MAX_STOP_STRING_CHARS",
           "MAX_STOP_TOKEN_IDS", "MAX_BAD_WORDS", "MAX_BAD_WORD_CHARS", "REPETITION_PENALTY_RANGE", "check_bad_words",
           "check_floats", "check_grammar", "check_params", "check_prompt", "check_stops", "truncated",
           "validate_prompt", "validate_request"]

MAX_STOP_STRINGS = 64  # each is searched for in the new text of every step
MAX_STOP_STRING_CHARS = 256  # a stream holds back this many characters minus one while a stop may begin
MAX_STOP_TOKEN_IDS = 256
MAX_BAD_WORDS = 64  # each bans its next token wherever the answer is spelling it: checked every token
MAX_BAD_WORD_CHARS = 256
# repetition_penalty divides positive float32 logits and multiplies negative ones: inside this range a logit
# of magnitude 1e4, then divided by the smallest sampling temperature (1e-5), stays far below float32's max
REPETITION_PENALTY_RANGE = (1e-6, 1e6)
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


class RequestError(ValueError):
    """A request the engine would refuse. `param` names the request field at fault (the server's 400 names
    it; the OpenAI server renames max_tokens and prompt to the fields its route uses)."""

    def __init__(self, message: str, param: str | None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class RequestLimits:
    """The engine's limits a request is checked against (sent by the core at start-up)."""

    max_model_len: int
    max_num_seqs: int
    vocab_size: int

    @classmethod
    def of(cls, engine: Any) -> "RequestLimits":
        """From an EngineClient's attributes."""
        return cls(int(engine.max_model_len), int(engine.max_num_seqs), int(engine.vocab_size))


@dataclass(frozen=True)
class EngineRequest:
    """A validated request: prompt token ids in the vocabulary, params with max_tokens resolved to what fits."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None  # the text, when the prompt came as text


def check_stops(stop: Any, stop_token_ids: Any) -> None:
    """Counts and lengths of `stop` (a string or a list of them) and `stop_token_ids`; before SamplingParams
    is built, so a huge list is refused without being echoed in the message."""
    stops = [stop] if isinstance(stop, str) else stop
    if stops is not None:
        if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
            raise RequestError("stop must be a string, a list of strings or null", "stop")
        if len(stops) > MAX_STOP_STRINGS:
            raise RequestError(f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop")
        longest = max((len(s) for s in stops), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise RequestError(f"stop has a string of {longest} characters; at most {MAX_STOP_STRING_CHARS} "
                               "are allowed", "stop")
    if stop_token_ids is not None:
        if not isinstance(stop_token_ids, (list, tuple)):
            raise RequestError("stop_token_ids must be a list of token ids or null", "stop_token_ids")
        if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise RequestError(f"stop_token_ids has {len(stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are "
                               "allowed", "stop_token_ids")


def check_bad_words(words: list[str] | None) -> None:
    """The count and length of bad_words (SamplingParams checked their type)."""
    if not words:
        return
    if len(words) > MAX_BAD_WORDS:
        raise RequestError(f"bad_words has {len(words)} words; at most {MAX_BAD_WORDS} are allowed", "bad_words")
    longest = max(len(w) for w in words)
    if longest > MAX_BAD_WORD_CHARS:
        raise RequestError(f"bad_words has a word of {longest} characters; at most {MAX_BAD_WORD_CHARS} are "
                           "allowed", "bad_words")


def truncated(ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens (left truncation, the end of a chat is kept);
    -1: the last max_model_len - 1, the most that leaves room for one output token."""
    k = params.truncate_prompt_tokens
    if k is None:
        return ids
    if k > max_model_len:
        raise RequestError(f"truncate_prompt_tokens ({k}) is greater than max_model_len ({max_model_len}); "
                           "select a smaller truncation size", "truncate_prompt_tokens")
    k = max_model_len - 1 if k == -1 else k
    return ids[-k:] if len(ids) > k else ids


def _float32(x: float) -> float:
    """x as the sampler's float32 tensors hold it (inf when beyond float32's range)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.inf


def check_floats(params: SamplingParams) -> None:
    """Every float in the range it is used at: the sampler works in float32."""
    for name in _FLOAT_FIELDS:
        v = getattr(params, name)
        if not math.isfinite(_float32(v)):
            raise RequestError(f"{name} must be a finite float32 number (|x| < 3.4e38), got {v!r}", name)
    if not _float32(params.top_p) > 0:
        raise RequestError(f"top_p must be in (0, 1] and not 0 in float32 (at least 1.5e-45), got "
                           f"{params.top_p!r}", "top_p")
    lo, hi = REPETITION_PENALTY_RANGE
    if not lo <= params.repetition_penalty <= hi:
        raise RequestError(f"repetition_penalty must be in [{lo:g}, {hi:g}] (it scales float32 logits), got "
                           f"{params.repetition_penalty!r}", "repetition_penalty")


def field_of(message: str) -> str | None:
    """The field a SamplingParams message names first ('temperature must be >= 0, got -1.0')."""
    m = re.match(r"(\w+)", message)
    return m.group(1) if m else None


def revalidate(params: SamplingParams) -> None:
    """SamplingParams.revalidate, its ValueError a RequestError naming the field (a field changed after the
    object was built)."""
    try:
        params.revalidate()
    except ValueError as e:
        raise RequestError(str(e), field_of(str(e))) from None


def check_params(params: SamplingParams, limits: RequestLimits) -> None:
    """What SamplingParams cannot know alone: samples per request against max_num_seqs, stop caps, float32."""
    if not isinstance(params, SamplingParams):
        raise RequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}", None)
    most = limits.max_num_seqs
    for name, v in (("n", params.n), ("best_of", params.best_of)):
        if v is not None and most and v > most:
            raise RequestError(f"{name} is {v}, more samples than this server runs at once "
                               f"(--max-num-seqs {most})", name)
    check_stops(params.stop, params.stop_token_ids)
    check_bad_words(params.bad_words)
    revalidate(params)
    check_floats(params)
    check_logit_bias(params, limits.vocab_size)


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    """Every biased or allowed token id in the vocabulary (SamplingParams checked the rest)."""
    for field, ids in (("logit_bias", params.logit_bias or ()),
                       ("allowed_token_ids", params.allowed_token_ids or ())):
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise RequestError(f"{field} has token id {bad}, outside the vocabulary (ids are in "
                               f"[0, {vocab_size}))", field)


def check_grammar(params: SamplingParams) -> None:
    """structured_outputs parsed by xgrammar (the OpenAI server calls this off its event loop)."""
    so = params.structured_outputs
    if so is not None:
        try:
            parse_grammar(so)
        except ValueError as e:
            raise RequestError(str(e), f"structured_outputs.{so.kind}") from None


def check_prompt(ids: list[int], limits: RequestLimits, field: str = "prompt") -> None:
    """Token ids: at least one, each an int in the vocabulary, leaving room for one output token."""
    n, size, limit = len(ids), limits.vocab_size, limits.max_model_len
    if n == 0:
        raise RequestError(f"'{field}' is empty: at least one token is needed", field)
    bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < size), None)
    if bad is not None:
        if not isinstance(bad, int) or isinstance(bad, bool):
            raise RequestError(f"'{field}' must hold token ids (integers >= 0), got {type(bad).__name__} "
                               f"{_short(bad)}", field, "invalid_type")
        raise RequestError(f"'{field}' has token id {bad}, outside the vocabulary (ids are in [0, {size}))",
                           field)
    if n >= limit:
        raise RequestError(f"'{field}' has {n} tokens, but this model's maximum context length is {limit} "
                           "tokens (max_model_len) and the prompt must leave room for at least one output "
                           "token", field, "context_length_exceeded")


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _fit(n: int, params: SamplingParams, limit: int, prompt_field: str, max_field: str) -> SamplingParams:
    """max_tokens resolved: what fits after the prompt when it is None; a RequestError when the prompt plus
    max_tokens exceeds max_model_len."""
    if params.max_tokens is None:
        if params.min_tokens > limit - n:
            raise RequestError(f"min_tokens must be <= max_tokens ({limit - n}: what fits after the "
                               f"{prompt_field}), got {params.min_tokens}", "min_tokens")
        return dataclasses.replace(params, max_tokens=limit - n)
    if n + params.max_tokens > limit:
        raise RequestError(f"this model's maximum context length is {limit} tokens, but "
                           f"{n + params.max_tokens} were requested ({n} in the {prompt_field}, "
                           f"{params.max_tokens} in the completion); reduce the {prompt_field} or "
                           f"'{max_field}'", max_field, "context_length_exceeded")
    return params


def validate_prompt(request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    limits: RequestLimits, prompt: str | None = None, *, prompt_field: str = "prompt",
                    max_tokens_field: str = "max_tokens") -> EngineRequest:
    """One prompt of a request whose params passed check_params (a batch of prompts shares them).
    `prompt_field` and `max_tokens_field` are the names the caller's API uses (chat: messages,
    max_completion_tokens), so the RequestError names the field the client sent."""
    if not isinstance(request_id, str) or not request_id:
        raise RequestError(f"request_id must be a non-empty string, got {request_id!r}", None)
    ids = truncated(list(prompt_token_ids), params, limits.max_model_len)
    check_prompt(ids, limits, prompt_field)
    params = _fit(len(ids), params, limits.max_model_len, prompt_field, max_tokens_field)
    return EngineRequest(request_id, ids, params, prompt)


def validate_request(request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     limits: RequestLimits, prompt: str | None = None, *, prompt_field: str = "prompt",
                     max_tokens_field: str = "max_tokens") -> EngineRequest:
    """The one validation of a request: check_params, the output constraint's grammar, then validate_prompt
    (RequestError naming the field)."""
    check_params(params, limits)
    check_grammar(params)
    return validate_prompt(request_id, prompt_token_ids, params, limits, prompt, prompt_field=prompt_field,
                           max_tokens_field=max_tokens_field)
