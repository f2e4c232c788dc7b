"""Per-request sampling settings, named and defaulted like vLLM's so user code ports unchanged."""

from dataclasses import dataclass
from numbers import Real

# Below this temperature, dividing logits overflows float32; such rows are treated as greedy.
SAMPLING_EPS = 1e-5


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


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

    def __post_init__(self) -> None:
        _require(_is_int(self.n) and self.n == 1, f"n must be 1 (only n=1 is supported), got {self.n!r}")
        self._check_real("temperature", lambda t: t >= 0, ">= 0")
        self._check_real("top_p", lambda p: 0 < p <= 1, "in (0, 1]")
        self._check_real("min_p", lambda p: 0 <= p <= 1, "in [0, 1]")
        self._check_real("repetition_penalty", lambda r: r > 0, "> 0")
        self._check_real("presence_penalty", lambda p: -2 <= p <= 2, "in [-2, 2]")
        self._check_real("frequency_penalty", lambda p: -2 <= p <= 2, "in [-2, 2]")
        _require(_is_int(self.top_k) and (self.top_k >= 1 or self.top_k in (-1, 0)),
                 f"top_k must be -1 or 0 (disabled) or an int >= 1, got {self.top_k!r}")
        if self.top_k == 0:
            self.top_k = -1  # one spelling of "disabled" keeps the sampler's checks simple
        _require(self.seed is None or _is_int(self.seed), f"seed must be an int or None, got {self.seed!r}")
        _require(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
                 f"max_tokens must be None or an int >= 1, got {self.max_tokens!r}")
        _require(_is_int(self.min_tokens) and self.min_tokens >= 0,
                 f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        _require(self.max_tokens is None or self.min_tokens <= self.max_tokens,
                 f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _require(self.logprobs is None, f"logprobs is not supported yet, got {self.logprobs!r}")
        self.stop = self._normalise_stop(self.stop)
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        _require(isinstance(ids, (list, tuple)) and all(_is_int(t) and t >= 0 for t in ids),
                 f"stop_token_ids must be a list of ints >= 0, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(ids)

    def _check_real(self, name: str, ok, allowed: str) -> None:
        value = getattr(self, name)
        # `ok` is written so NaN fails it (every comparison with NaN is False).
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

    @property
    def is_greedy(self) -> bool:
        """Greedy rows skip temperature, masks and random draws entirely."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        """Only rows that need penalties pay for building token-count tensors."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def max_stop_str_len(self) -> int:
        """How many trailing characters the detokenizer must hold back before a stop string can be ruled out."""
        return max((len(s) for s in self.stop), default=0)
