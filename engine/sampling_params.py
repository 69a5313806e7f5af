"""Per-request sampling parameters, with vLLM's field names, validated when built."""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any

# Re-exported: vLLM's users import StructuredOutputsParams from here.
from xlaserve.structured_outputs_params import StructuredOutputsError, StructuredOutputsParams, is_int

__all__ = [
    "DEFAULT_MAX_LOGPROBS",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsError",
    "StructuredOutputsParams",
]

logger = logging.getLogger(__name__)

# The default of the engine's max_logprobs (vLLM's --max-logprobs): the most top logprobs a request may
# ask per token, and the width of the sampler's top-k. A request's count is checked against the engine's
# value where the engine is known (InputProcessor.validate_params), not here.
DEFAULT_MAX_LOGPROBS = 20

# Below this temperature sampling is argmax: dividing logits by ~0 would overflow.
_GREEDY_EPSILON = 1e-5
_MAX_BIAS = 3.4e38  # float32's largest finite value, about: the logits' dtype
# vLLM's _MAX_TEMP: a temperature in (0, this) is raised to it, with a warning (logits divided by less
# overflow to inf and nan); 0 stays greedy.
_MIN_TEMPERATURE = 1e-2


class RequestOutputKind(Enum):
    """Which outputs a streaming caller (AsyncLLM.generate) gets for a request: vLLM's enum, names and
    values, imported as vLLM's users import it (`from xlaserve.sampling_params import RequestOutputKind`).
    The offline LLM always returns final outputs, whatever a request says (as vLLM's)."""

    CUMULATIVE = 0  # every step: everything generated so far
    DELTA = 1  # every step: only what is new since the previous output
    FINAL_ONLY = 2  # one output, when the request finishes

    @property
    def mode(self) -> str:
        """The output processor's name for it (engine/engine/output_processor.py OUTPUT_KINDS)."""
        return ("cumulative", "delta", "final")[self.value]


def as_token_ids(values) -> list:
    """`values` as a list, numpy integers made ints (vLLM takes them where its checks are comparisons:
    prompts, allowed_token_ids); anything else is left for the caller's check to name."""
    return [int(v) if isinstance(v, numbers.Integral) and not isinstance(v, bool) else v for v in values]


def _unique(values) -> list:
    """`values` as a list without repeats, in first-occurrence order (unhashable values, which the
    checks then name, are kept as given)."""
    try:
        return list(dict.fromkeys(values))
    except TypeError:
        return list(values)


def _require(is_ok: bool, message: str) -> None:
    if not is_ok:
        raise ValueError(message)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's continuation.

    Frozen: the engine resolves `max_tokens=None` with `dataclasses.replace`, never in place.
    `stop` and `stop_token_ids` are normalized to lists, `stop_token_ids` and `bad_words` without repeats
    (first occurrence kept); `top_k=-1` is normalized to 0 (disabled) and `seed=-1` to None (unseeded),
    as vLLM's. `logprobs` and `prompt_logprobs` of -1 ask for the whole vocabulary (the input processor
    resolves them against the model's; the engine's max_logprobs must allow it, as vLLM's).
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
    # False: an added token right after another is output as its text alone, without the space a
    # decoder (WordPiece, a slow tokenizer) puts between them; vLLM's (no effect with skip_special_tokens).
    spaces_between_special_tokens: bool = True
    # False: no text (outputs carry token ids, logprobs no decoded tokens), as vLLM's: a trainer that
    # reads ids skips the detokenizer's work. Stop strings need the text.
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # Added to the logits before sampling (token id -> bias; the HTTP routes clamp it to OpenAI's
    # [-100, 100], as vLLM's), and the only tokens that may be sampled (None: all); logprobs stay those
    # of the raw distribution, as vLLM's.
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    # The prompt's last this many tokens only (-1: as many as the context holds; None: all), vLLM's.
    truncate_prompt_tokens: int | None = None
    # Words never generated (vLLM's): a word's last token is banned where the output ends with the
    # tokens before it (a one-token word: always). The input processor fills bad_words_token_ids from
    # the tokenizer (each word as written and after a space).
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # vLLM's output_kind, for AsyncLLM.generate (its own output_kind argument, where given, comes first).
    # None, not vLLM's CUMULATIVE: AsyncLLM streamed deltas before this field existed, and still does
    # for a request that names no kind.
    output_kind: RequestOutputKind | None = None
    # vLLM's extra_args: what a connector or plug-in reads. "kv_transfer_params" (disaggregated
    # prefill, README "Disaggregated prefill"): {"do_remote_decode": true} asks a producer to run the
    # prefill only and keep the blocks for a consumer; the response's kv_transfer_params, sent to the
    # consumer, make it fetch them ({"do_remote_prefill": true, "remote_host", "remote_port",
    # "remote_request_id"}).
    extra_args: dict[str, Any] | None = None

    def __post_init__(self):
        self._normalize()
        self._validate_extra_args()
        self._validate_sampling()
        self._validate_lengths()
        self._validate_logprobs()
        self._validate_penalties()
        self._validate_stops()
        self._validate_token_biases()
        self._validate_truncation()
        self._validate_bad_words()

    def _normalize(self) -> None:
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        object.__setattr__(self, "stop", list(stop))
        # vLLM's: a repeated stop token or bad word is one (its first occurrence keeps its place).
        object.__setattr__(self, "stop_token_ids", _unique(self.stop_token_ids or []))
        if isinstance(self.bad_words, list):
            object.__setattr__(self, "bad_words", _unique(self.bad_words))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.seed == -1 and is_int(self.seed):  # vLLM's "no seed": each request draws its own
            object.__setattr__(self, "seed", None)
        if isinstance(self.temperature, (int, float)) and 0 < self.temperature < _MIN_TEMPERATURE:
            logger.warning(
                "temperature %s is below %s, which may turn the logits into inf or nan: raised to %s",
                self.temperature,
                _MIN_TEMPERATURE,
                _MIN_TEMPERATURE,
            )
            object.__setattr__(self, "temperature", _MIN_TEMPERATURE)
        for name in ("logprobs", "prompt_logprobs"):
            # vLLM's: True is 1. False is None here, not vLLM's 0 (the sampled token's logprob): a
            # caller writing logprobs=False asks for none.
            if isinstance(getattr(self, name), bool):
                object.__setattr__(self, name, 1 if getattr(self, name) else None)
        if isinstance(self.allowed_token_ids, list):
            object.__setattr__(self, "allowed_token_ids", as_token_ids(self.allowed_token_ids))
        if isinstance(self.structured_outputs, dict):
            unknown = set(self.structured_outputs) - {f.name for f in fields(StructuredOutputsParams)}
            _require(not unknown, f"structured_outputs has unknown members {sorted(unknown)}")
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams(**self.structured_outputs))
        so = self.structured_outputs
        _require(
            so is None or isinstance(so, StructuredOutputsParams),
            f"structured_outputs must be a StructuredOutputsParams, got {type(so).__name__}",
        )

    def _validate_extra_args(self) -> None:
        _require(
            self.extra_args is None or isinstance(self.extra_args, dict),
            f"extra_args must be an object, got {type(self.extra_args).__name__}",
        )
        params = self.kv_transfer_params
        if params is None:
            return
        _require(isinstance(params, dict), "kv_transfer_params must be an object")
        for name in ("do_remote_decode", "do_remote_prefill"):
            _require(isinstance(params.get(name, False), bool), f"kv_transfer_params.{name} must be a bool")
        if params.get("do_remote_decode"):
            _require(
                not params.get("do_remote_prefill"),
                "kv_transfer_params: do_remote_decode and do_remote_prefill cannot both be true",
            )
            _require(self.n == 1, f"kv_transfer_params.do_remote_decode needs n=1, got n={self.n}")
        if params.get("do_remote_prefill"):
            host, port, rid = (params.get(k) for k in ("remote_host", "remote_port", "remote_request_id"))
            _require(
                isinstance(host, str) and 0 < len(host) <= 255,
                f"kv_transfer_params.remote_host must be a host name, got {host!r}",
            )
            _require(
                is_int(port) and 1 <= port <= 65535,
                f"kv_transfer_params.remote_port must be in [1, 65535], got {port!r}",
            )
            _require(
                isinstance(rid, str) and 0 < len(rid) <= 256,
                f"kv_transfer_params.remote_request_id must be a string of 1 to 256 characters, got {rid!r}",
            )

    @property
    def kv_transfer_params(self) -> dict | None:
        """extra_args["kv_transfer_params"] (None: none)."""
        return None if self.extra_args is None else self.extra_args.get("kv_transfer_params")

    def _validate_sampling(self) -> None:
        _require(is_int(self.n) and self.n >= 1, f"n must be an int >= 1, got {self.n!r}")
        _require(math.isfinite(self.temperature), f"temperature must be finite, got {self.temperature}")
        _require(0 <= self.temperature <= 2, f"temperature must be in [0, 2], got {self.temperature}")
        # vLLM's: greedy children would all be the same sequence (a beam search is not SamplingParams).
        _require(not self.is_greedy or self.n == 1, f"n must be 1 when using greedy sampling, got {self.n}")
        _require(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _require(
            is_int(self.top_k) and self.top_k >= 0,
            f"top_k must be -1 (disabled) or an int >= 0, got {self.top_k!r}",
        )
        _require(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        _require(self.seed is None or is_int(self.seed), f"seed must be an int or None, got {self.seed!r}")
        _require(
            self.output_kind is None or isinstance(self.output_kind, RequestOutputKind),
            f"output_kind must be a RequestOutputKind or None, got {self.output_kind!r}",
        )

    def _validate_lengths(self) -> None:
        _require(
            self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1),
            f"max_tokens must be an int >= 1 or None, got {self.max_tokens!r}",
        )
        _require(
            is_int(self.min_tokens) and self.min_tokens >= 0,
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
                value is None or (is_int(value) and value >= -1),
                f"{name} must be an int >= 0, -1 (the whole vocabulary) or None, got {value!r}",
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
        _require(
            self.detokenize or not self.stop,
            f"stop strings {self.stop!r} need detokenize=True (they are matched in the text); "
            "use stop_token_ids",
        )
        for stop in self.stop:
            _require(isinstance(stop, str) and stop != "", f"stop strings must be non-empty, got {stop!r}")
        for token_id in self.stop_token_ids:
            _require(
                is_int(token_id) and token_id >= 0,
                f"stop_token_ids must be ints >= 0, got {token_id!r}",
            )

    def _validate_bad_words(self) -> None:
        words = self.bad_words
        if words is not None:
            _require(
                isinstance(words, list) and len(words) <= 128,
                f"bad_words must be a list of at most 128 strings, got {words!r}",
            )
            for word in words:
                _require(
                    isinstance(word, str) and word.strip() != "",
                    f"bad_words must be non-empty strings, got {word!r}",
                )
        for ids in self.bad_words_token_ids or ():
            _require(
                isinstance(ids, list) and len(ids) > 0 and all(is_int(t) and t >= 0 for t in ids),
                f"bad_words_token_ids must be non-empty lists of token ids, got {ids!r}",
            )

    @property
    def reads_output_tokens(self) -> bool:
        """True when the logits depend on the output so far (penalties, a bad word of several tokens):
        async scheduling must know the previous step's token before building the next."""
        return self.has_penalties or self.bans_follow_output

    @property
    def bans_follow_output(self) -> bool:
        """True when a bad word has several tokens: its last token is banned only after the others, so
        the ban at a position depends on the tokens before it (a drafted position's too)."""
        return any(len(ids) > 1 for ids in self.bad_words_token_ids or ())

    def _validate_truncation(self) -> None:
        keep = self.truncate_prompt_tokens
        _require(
            keep is None or (is_int(keep) and (keep >= 1 or keep == -1)),
            f"truncate_prompt_tokens must be an int >= 1, or -1 (the context's length), got {keep!r}",
        )

    def _validate_token_biases(self) -> None:
        bias = self.logit_bias
        if bias is not None:
            _require(isinstance(bias, dict), f"logit_bias must be a dict of token id -> bias, got {bias!r}")
            for token_id, value in bias.items():
                _require(
                    is_int(token_id) and token_id >= 0,
                    f"logit_bias keys must be token ids (ints >= 0), got {token_id!r}",
                )
                # vLLM's constructor takes any bias (its HTTP routes clamp to [-100, 100]: engine_io); only
                # one that is inf on the device, which turns the logits into nan, is refused.
                _require(
                    isinstance(value, (int, float))
                    and not isinstance(value, bool)
                    and abs(value) <= _MAX_BIAS,
                    f"logit_bias values must be finite float32 numbers, got {value!r} for token {token_id}",
                )
        allowed = self.allowed_token_ids
        if allowed is not None:
            _require(
                isinstance(allowed, list) and len(allowed) > 0,
                f"allowed_token_ids must be a non-empty list of token ids, got {allowed!r}",
            )
            for token_id in allowed:
                _require(
                    is_int(token_id) and token_id >= 0,
                    f"allowed_token_ids must be ints >= 0, got {token_id!r}",
                )

    @property
    def is_greedy(self) -> bool:
        """True when sampling is argmax (temperature ~ 0)."""
        return self.temperature < _GREEDY_EPSILON

    @property
    def has_penalties(self) -> bool:
        """True when any presence/frequency/repetition penalty changes the logits."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def has_token_biases(self) -> bool:
        """True when a logit bias or an allowed-token list changes the logits (the sampler's [R, V]
        bias, as the penalties)."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words_token_ids)
