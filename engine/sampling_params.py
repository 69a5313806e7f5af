"""Per-request sampling parameters, with vLLM's field names, validated when built."""

from __future__ import annotations

import math
from dataclasses import dataclass

# The sampler returns at most this many top logprobs per token (vLLM's default cap).
MAX_LOGPROBS = 20

# Below this temperature sampling is argmax: dividing logits by ~0 would overflow.
_GREEDY_EPSILON = 1e-5


def _require(is_ok: bool, message: str) -> None:
    if not is_ok:
        raise ValueError(message)


def _is_int(value) -> bool:
    # bool is an int subclass, but True as a token id or count is always a caller bug.
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's continuation.

    Frozen: the engine resolves `max_tokens=None` with `dataclasses.replace`, never in place.
    `stop` and `stop_token_ids` are normalized to lists; `top_k=-1` is normalized to 0 (disabled).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True

    def __post_init__(self):
        self._normalize()
        self._validate_sampling()
        self._validate_lengths()
        self._validate_logprobs()
        self._validate_penalties()
        self._validate_stops()

    def _normalize(self) -> None:
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        object.__setattr__(self, "stop", list(stop))
        object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids or []))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)

    def _validate_sampling(self) -> None:
        _require(_is_int(self.n) and self.n >= 1, f"n must be an int >= 1, got {self.n!r}")
        _require(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _require(math.isfinite(self.temperature), f"temperature must be finite, got {self.temperature}")
        _require(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _require(
            _is_int(self.top_k) and self.top_k >= 0,
            f"top_k must be -1 (disabled) or an int >= 0, got {self.top_k!r}",
        )
        _require(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        _require(self.seed is None or _is_int(self.seed), f"seed must be an int or None, got {self.seed!r}")

    def _validate_lengths(self) -> None:
        _require(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            f"max_tokens must be an int >= 1 or None, got {self.max_tokens!r}",
        )
        _require(
            _is_int(self.min_tokens) and self.min_tokens >= 0,
            f"min_tokens must be an int >= 0, got {self.min_tokens!r}",
        )
        _require(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
        )

    def _validate_logprobs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(
                value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS),
                f"{name} must be in [0, {MAX_LOGPROBS}] or None, got {value!r}",
            )

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(-2 <= value <= 2, f"{name} must be in [-2, 2], got {value}")
        _require(
            self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty),
            f"repetition_penalty must be > 0, got {self.repetition_penalty}",
        )

    def _validate_stops(self) -> None:
        for stop in self.stop:
            _require(isinstance(stop, str) and stop != "", f"stop strings must be non-empty, got {stop!r}")
        for token_id in self.stop_token_ids:
            _require(
                _is_int(token_id) and token_id >= 0,
                f"stop_token_ids must be ints >= 0, got {token_id!r}",
            )

    @property
    def is_greedy(self) -> bool:
        """True when sampling is argmax (temperature ~ 0)."""
        return self.temperature < _GREEDY_EPSILON

    @property
    def has_penalties(self) -> bool:
        """True when any presence/frequency/repetition penalty changes the logits."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
