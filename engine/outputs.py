"""What the engine hands back to users: vLLM-named output dataclasses.

The engine core speaks token ids and raw logprob payloads (`LogprobsEntry`); the output processor
turns them into these objects, with text, decoded tokens and timing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# One position's logprobs as the engine core sends them: token ids and logprobs with the sampled
# (or actual prompt) token first, then the top-n tokens in descending order, and the 1-based rank
# of that first token in the full distribution.
LogprobsEntry = tuple[list[int], list[float], int]


def _summarize(logprobs: list | None) -> str:
    # Logprobs can be thousands of dicts; in a repr the count is what a reader of a log wants.
    return "None" if logprobs is None else f"<{len(logprobs)} positions>"


@dataclass
class Logprob:
    """The logprob of one token at one position, with its rank and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def make_logprob_dict(entry: LogprobsEntry, token_text: Callable[[int], str]) -> dict[int, Logprob]:
    """One position's payload as token id -> Logprob, with `token_text(id)` as decoded_token."""
    token_ids, logprobs, first_rank = entry
    # The first id is the sampled (or actual prompt) token with its own rank; the rest are the top-n
    # in order. If the sampled token is also in the top-n, its top-n entry (the same rank) wins.
    ranks = [first_rank, *range(1, len(token_ids))]
    return {
        int(token_id): Logprob(float(logprob), rank, token_text(int(token_id)))
        for token_id, logprob, rank in zip(token_ids, logprobs, ranks, strict=True)
    }


# One dict per generated token: token id -> Logprob (the sampled token and the top-n).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; position 0 has nothing to condition on, so it is None.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestStateStats:
    """Per-request timing, in the clock of `arrival_time` (seconds)."""

    arrival_time: float = 0.0
    scheduled_time: float | None = None  # first scheduled (the core's EngineCoreOutput.scheduled_time)
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0

    @property
    def first_token_latency(self) -> float | None:
        """Time to first token, or None before it arrived."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class IterationStats:
    """Metric samples gathered since the caller last drained them (`drain_stats`), in seconds."""

    num_prompt_tokens: int = 0  # prompts of requests that got their first token
    # Those prompts' tokens by where their K/V came from (vLLM's PromptTokenStats): computed here, from
    # the prefix cache, loaded by a KV connector; `num_prompt_tokens_cached` is the hit. vLLM counts a
    # prompt whose hit left exactly one token to compute as a whole prompt cached with its last token
    # recomputed (`num_prompt_tokens_recomputed`: one), that token both computed and a cache hit, so
    # computed + local_cache_hit + external - recomputed = num_prompt_tokens. Counted as vLLM does, so
    # that its dashboards read the same (a hit is whole blocks: that token was never cached here).
    num_prompt_tokens_computed: int = 0
    num_prompt_tokens_local_cache_hit: int = 0
    num_prompt_tokens_external: int = 0
    num_prompt_tokens_cached: int = 0
    num_prompt_tokens_recomputed: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)  # one per step per request
    time_per_output_tokens: list[float] = field(default_factory=list)  # one per finished request
    e2e_latencies: list[float] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    # One per finished request (vLLM's): its prompt's and output's tokens; seconds waiting before it was
    # first scheduled, then from there to its first token (prefill), from its first token to its last
    # (decode), and from being scheduled to its last token (inference). The times of a request never
    # scheduled, or without tokens, are left out.
    prompt_lengths: list[int] = field(default_factory=list)
    generation_lengths: list[int] = field(default_factory=list)
    # Its prompt's tokens past its cache hit (vLLM's request_prefill_kv_computed_tokens).
    prefill_kv_computed_tokens: list[int] = field(default_factory=list)
    queue_times: list[float] = field(default_factory=list)
    prefill_times: list[float] = field(default_factory=list)
    decode_times: list[float] = field(default_factory=list)
    inference_times: list[float] = field(default_factory=list)
    # The max_tokens of each finished core-level request that set one (vLLM's request_params_max_tokens),
    # and per finished user request, once all its n sequences have ended: its n, and the most tokens one
    # of them generated (vLLM's request_params_n and request_max_num_generation_tokens).
    max_tokens_params: list[int] = field(default_factory=list)
    n_params: list[int] = field(default_factory=list)
    max_num_generation_tokens: list[int] = field(default_factory=list)

    def record_tokens(
        self,
        stats: RequestStateStats,
        num_prompt_tokens: int,
        num_new_tokens: int,
        now: float,
        num_cached_tokens: int = 0,
        num_external_tokens: int = 0,
    ) -> None:
        """Account a request's tokens of one step: a TTFT sample and its prompt's on its first (of which
        `num_cached_tokens` hit a cache, `num_external_tokens` of them loaded by a KV connector), else a
        latency."""
        if num_new_tokens == 0:
            return
        if stats.first_token_time is None:
            stats.first_token_time = now
            self.time_to_first_tokens.append(now - stats.arrival_time)
            self._record_prompt(num_prompt_tokens, num_cached_tokens, num_external_tokens)
        else:
            self.inter_token_latencies.append(now - stats.last_token_time)
        stats.last_token_time = now
        stats.num_generation_tokens += num_new_tokens
        self.num_generation_tokens += num_new_tokens

    def _record_prompt(self, num_prompt_tokens: int, num_cached_tokens: int, num_external: int) -> None:
        num_recomputed = int(num_cached_tokens + 1 == num_prompt_tokens)  # the field comment's
        self.num_prompt_tokens += num_prompt_tokens
        self.num_prompt_tokens_computed += num_prompt_tokens - num_cached_tokens
        self.num_prompt_tokens_local_cache_hit += num_cached_tokens + num_recomputed - num_external
        self.num_prompt_tokens_external += num_external
        self.num_prompt_tokens_cached += num_cached_tokens
        self.num_prompt_tokens_recomputed += num_recomputed

    def record_finish(
        self,
        stats: RequestStateStats,
        finish_reason: str,
        now: float,
        num_prompt_tokens: int,
        max_tokens: int | None = None,
        num_cached_tokens: int = 0,
    ) -> None:
        """Account a finished request: its latencies, mean time per output token, lengths, the prompt's
        tokens it computed and max_tokens (None: it set none)."""
        if max_tokens is not None:
            self.max_tokens_params.append(max_tokens)
        self.e2e_latencies.append(now - stats.arrival_time)
        self.finish_reasons.append(finish_reason)
        self.prompt_lengths.append(num_prompt_tokens)
        self.prefill_kv_computed_tokens.append(num_prompt_tokens - num_cached_tokens)
        self.generation_lengths.append(stats.num_generation_tokens)
        if stats.num_generation_tokens > 1:
            decode_time = stats.last_token_time - stats.first_token_time
            self.time_per_output_tokens.append(decode_time / (stats.num_generation_tokens - 1))
        if stats.scheduled_time is not None:
            self.queue_times.append(max(stats.scheduled_time - stats.arrival_time, 0.0))
            if stats.first_token_time is not None:
                # Clocks of two processes (one host): a step faster than their skew reads 0, not less.
                self.prefill_times.append(max(stats.first_token_time - stats.scheduled_time, 0.0))
                self.decode_times.append(stats.last_token_time - stats.first_token_time)
                self.inference_times.append(max(stats.last_token_time - stats.scheduled_time, 0.0))


@dataclass
class CompletionOutput:
    """One sampled sequence of a request (index i of the request's n).

    In delta mode `text`, `token_ids` and `logprobs` hold only what is new since the previous
    output; `cumulative_logprob` is always the running total.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        """Whether this sequence has ended."""
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
            f"cumulative_logprob={self.cumulative_logprob}, logprobs={_summarize(self.logprobs)}, "
            f"finish_reason={self.finish_reason!r}, stop_reason={self.stop_reason!r})"
        )


@dataclass
class RequestOutput:
    """Everything a caller sees of one request at one point in time."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # The prompt's tokens this request wrote to the prefix cache: its whole blocks past its hit (vLLM's
    # num_cache_creation_tokens, counted as vLLM's: a block another copy already held counts too; 0
    # without prefix caching).
    num_cache_creation_tokens: int = 0
    metrics: RequestStateStats | None = field(default=None)
    # A KV connector's, when the request finished: a disaggregated-prefill producer's say where a
    # consumer fetches the prompt's blocks (pass them as SamplingParams.extra_args["kv_transfer_params"]).
    kv_transfer_params: dict | None = None

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, "
            f"prompt_logprobs={_summarize(self.prompt_logprobs)}, outputs={self.outputs}, "
            f"finished={self.finished}, num_cached_tokens={self.num_cached_tokens}, "
            f"metrics={self.metrics})"
        )


# -- pooling models (runner="pooling"): vLLM's output types -----------------------------------------


@dataclass
class PoolingOutput:
    """A pooling request's raw result: a vector (or, ALL pooling, one row per prompt token)."""

    data: Any


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput:
    """One prompt's result (`outputs`: one of the outputs above), in the order of the prompts."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool = True


class EmbeddingRequestOutput(PoolingRequestOutput):
    """`outputs` is an EmbeddingOutput."""


class ClassificationRequestOutput(PoolingRequestOutput):
    """`outputs` is a ClassificationOutput."""


class ScoringRequestOutput(PoolingRequestOutput):
    """`outputs` is a ScoringOutput."""
