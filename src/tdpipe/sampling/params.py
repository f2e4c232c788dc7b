"""Per-request sampling settings, named and defaulted like vLLM's so user code ports unchanged."""

import copy
import math
from dataclasses import dataclass, fields
from enum import IntEnum
from numbers import Integral, Real
from typing import Any

from tdpipe.sampling.structured import StructuredOutputsParams

# Below this temperature, dividing logits overflows float32; such rows are treated as greedy.
SAMPLING_EPS = 1e-5

# Most top logprobs a request may ask for (vLLM's default max_logprobs; OpenAI's top_logprobs limit).
MAX_LOGPROBS = 20

# The seeds torch's generators take (and vLLM passes on to them): int64 below zero, uint64 above.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


class RequestOutputKind(IntEnum):
    """What AsyncLLM.generate yields as a request advances (vLLM's names and values): the whole output so far,
    only what is new since the last yield, or the finished output alone (what RL rollouts ask for)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _is_int(x) -> bool:
    """Python and numpy integers; never bool (True would silently mean 1) nor a float that happens to be whole."""
    return isinstance(x, Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """How to pick tokens for one request. Validated eagerly so bad input fails at submit time,
    not deep inside a batched step where it would take other requests down with it."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    best_of: int | None = None
    structured_outputs: StructuredOutputsParams | None = None  # a dict with its fields is accepted too
    detokenize: bool = True  # False: token ids only, text "" (vLLM's; RL rollouts skip the decoding)
    logit_bias: dict[int, float] | None = None  # OpenAI's: token id -> a bias in [-100, 100] on its logit
    allowed_token_ids: list[int] | None = None  # vLLM's: the only tokens the row may produce
    bad_words: list[str] | None = None  # vLLM's: words the answer must not contain (sampling/bad_words.py)
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens; -1: all that fit
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # AsyncLLM.generate's yields (vLLM's)

    def __post_init__(self) -> None:
        self._check_int("n", lambda n: n >= 1, "an int >= 1")
        self._check_int("best_of", lambda b: b >= self.n, f"None or an int >= n ({self.n})", optional=True)
        self._check_real("temperature", lambda t: t >= 0, ">= 0")
        self._check_real("top_p", lambda p: 0 < p <= 1, "in (0, 1]")
        self._check_real("min_p", lambda p: 0 <= p <= 1, "in [0, 1]")
        self._check_real("repetition_penalty", lambda r: r > 0, "> 0")
        self._check_real("presence_penalty", lambda p: -2 <= p <= 2, "in [-2, 2]")
        self._check_real("frequency_penalty", lambda p: -2 <= p <= 2, "in [-2, 2]")
        self._check_int("top_k", lambda k: k >= 1 or k in (-1, 0), "-1 or 0 (disabled) or an int >= 1")
        if self.top_k == 0:
            self.top_k = -1  # one spelling of "disabled" keeps the sampler's checks simple
        # torch.Generator.manual_seed takes exactly this range; outside it the request would fail mid-batch
        self._check_int("seed", lambda s: SEED_MIN <= s <= SEED_MAX, "None or an int in [-2**63, 2**64 - 1]",
                        optional=True)
        self._check_int("max_tokens", lambda m: m >= 1, "None or an int >= 1", optional=True)
        self._check_int("min_tokens", lambda m: m >= 0, "an int >= 0")
        _require(self.max_tokens is None or self.min_tokens <= self.max_tokens,
                 f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "detokenize"):
            value = getattr(self, name)  # a string such as "no" is truthy: it would silently mean True
            _require(isinstance(value, bool), f"{name} must be a bool (True or False), got {value!r}")
        for name in ("logprobs", "prompt_logprobs"):
            self._check_int(name, lambda k: 0 <= k <= MAX_LOGPROBS, f"None or an int in [0, {MAX_LOGPROBS}]",
                            optional=True)
        self.stop = self._normalise_stop(self.stop)
        _require(self.detokenize or not self.stop, "stop strings need detokenize=True (they are found in the "
                 "text); use stop_token_ids with detokenize=False")
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        _require(isinstance(ids, (list, tuple)) and all(_is_int(t) and 0 <= t < (1 << 63) for t in ids),
                 f"stop_token_ids must be None or a list of ints >= 0, got {self.stop_token_ids!r}")
        self.stop_token_ids = [int(t) for t in ids]
        # looked up for every sampled token: a set (an attribute, not a field: asdict() and the history skip it)
        self.stop_token_set = frozenset(self.stop_token_ids)
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
        self.logit_bias = self._normalise_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            _require(isinstance(ids, (list, tuple)) and len(ids) > 0
                     and all(_is_int(t) and 0 <= t < (1 << 63) for t in ids),
                     "allowed_token_ids must be None or a non-empty list of token ids (ints >= 0), "
                     f"got {ids!r}")
            self.allowed_token_ids = sorted({int(t) for t in ids})
        words = self.bad_words
        _require(words is None or (isinstance(words, (list, tuple)) and all(isinstance(w, str) and w.strip()
                                                                             for w in words)),
                 f"bad_words must be None or a list of non-blank strings, got {words!r}")
        self.bad_words = list(words) if words else None
        # the words' token sequences, set by the engine from its tokenizer (an attribute, not a field)
        self.bad_words_token_ids: list[list[int]] = []
        self._check_int("truncate_prompt_tokens", lambda k: k >= 1 or k == -1, "None, -1 (all that fit) or an "
                        "int >= 1", optional=True)
        kinds = ", ".join(f"RequestOutputKind.{k.name}" for k in RequestOutputKind)
        _require(_is_int(self.output_kind) and int(self.output_kind) in set(RequestOutputKind),
                 f"output_kind must be one of {kinds}, got {self.output_kind!r}")
        self.output_kind = RequestOutputKind(int(self.output_kind))
        _require(self.output_kind != RequestOutputKind.DELTA or self.num_samples == self.n,
                 f"output_kind DELTA cannot go with best_of ({self.best_of}) > n ({self.n}): the best samples are "
                 "known only once all have finished (use CUMULATIVE or FINAL_ONLY)")
        # what the stage may do with a row, read for every row of every step (attributes, not fields; derived
        # again by revalidate(), which the engine runs for each request): its argmax, or a plain draw at a
        # temperature, where nothing reshapes the distribution (sampling/metadata.may_argmax, stage_rows)
        untouched = not self.needs_processing and not self.needs_logprobs and self.structured_outputs is None
        self.argmax_ok = self.is_greedy and untouched
        self.plain_draw = (untouched and self.seed is None and self.top_k == -1 and self.top_p >= 1.0
                           and self.min_p <= 0.0)
        object.__setattr__(self, "_checked", True)  # last: the normalisations above set fields

    def _check_int(self, name: str, ok, allowed: str, optional: bool = False) -> None:
        """Integral (numpy ints too, never bool or float) and `ok`; stored as a plain int."""
        value = getattr(self, name)
        if optional and value is None:
            return
        _require(_is_int(value) and ok(int(value)), f"{name} must be {allowed}, got {value!r}")
        setattr(self, name, int(value))

    def _check_real(self, name: str, ok, allowed: str) -> None:
        value = getattr(self, name)
        if _is_real(value) and not math.isfinite(value):  # inf passes `> 0`; NaN fails every `ok` anyway
            raise ValueError(f"{name} must be a finite number {allowed}, got {value!r}")
        _require(_is_real(value) and ok(value), f"{name} must be {allowed}, got {value!r}")
        setattr(self, name, float(value))

    @staticmethod
    def _normalise_stop(stop) -> list[str]:
        if stop is None:
            return []
        stops = [stop] if isinstance(stop, str) else stop
        _require(isinstance(stops, (list, tuple)) and all(isinstance(s, str) for s in stops),
                 f"stop must be a str, a list of str or None, got {stop!r}")
        _require(all(s for s in stops), "stop must not contain empty strings")
        return list(stops)

    @staticmethod
    def _normalise_bias(bias) -> dict[int, float] | None:
        """{token id: bias} as plain ints and floats; None for none. A bias outside [-100, 100] is refused, not
        clamped: OpenAI documents that range, and +-100 already forces or bans a token."""
        if bias is None or (isinstance(bias, dict) and not bias):
            return None
        _require(isinstance(bias, dict),
                 f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}")
        out = {}
        for t, b in bias.items():
            _require(_is_int(t) and 0 <= t < (1 << 63),
                     f"logit_bias keys must be token ids (ints >= 0), got {t!r}")
            _require(_is_real(b) and math.isfinite(b) and -100 <= b <= 100,
                     f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {t}")
            out[int(t)] = float(b)
        return out

    @property
    def needs_processing(self) -> bool:
        """The row's logits change before it samples (penalties, a logit bias, an allowed set, bad words): no
        argmax on the stage, no greedy hot path."""
        return (self.needs_penalties or self.logit_bias is not None or self.allowed_token_ids is not None
                or self.bad_words is not None)

    @property
    def is_greedy(self) -> bool:
        """Greedy rows skip temperature, masks and random draws entirely."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def num_samples(self) -> int:
        """Sequences generated for the request: best_of (ranked by cumulative logprob, n returned) or n."""
        return self.n if self.best_of is None else self.best_of

    @property
    def needs_logprobs(self) -> bool:
        """The sampler computes this row's log-probabilities: asked for, or needed to rank best_of samples."""
        return self.logprobs is not None or self.num_samples > self.n

    @property
    def needs_penalties(self) -> bool:
        """Only rows that need penalties pay for building token-count tensors."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def max_stop_str_len(self) -> int:
        """How many trailing characters the detokenizer must hold back before a stop string can be ruled out."""
        return max((len(s) for s in self.stop), default=0)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in _FIELDS:  # a field set: checked and derived again before the next request uses it
            object.__setattr__(self, "_checked", False)

    def revalidate(self) -> None:
        """Check the fields again and derive what is computed from them (the stop-token set, the normalised stop
        list, ...) if one was set since: a field set on a built object (RL code clones a template and sets
        fields per request) would otherwise be used unchecked, or not at all (a stop_token_ids set afterwards
        never stopped anything). The engine calls it for every request it takes; unchanged params cost nothing
        (a 5,000-id allowed_token_ids list takes ms to check). Set fields, do not change their lists in place."""
        if not self.__dict__.get("_checked"):
            self.__post_init__()

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's): RL code clones a template and changes fields per request."""
        return copy.deepcopy(self)


_FIELDS = frozenset(f.name for f in fields(SamplingParams))  # assignments that call for revalidate()
