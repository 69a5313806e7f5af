"""What crosses the layers each step: the scheduler's decision (SchedulerOutput, one
ScheduledRequest per request), the worker's answer (ModelRunnerOutput), and the per-request news the
engine core hands the output processor (EngineCoreOutput). Plain data: no jax, no behaviour beyond
derived fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from xlaserve.core.kv_cache_coordinator import StateCopy
from xlaserve.core.kv_cache_manager import PrefixCacheStats
from xlaserve.core.kv_connector import KVConnectorMetadata, KVTransferStats
from xlaserve.core.request import FinishReason, Request
from xlaserve.core.spec_decode import SpecDecodingStats


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute all_token_ids[num_computed_tokens:] + spec_token_ids,
    num_new_tokens in all (the drafts, when there are any, are the last len(spec_token_ids))."""

    request: Request
    num_new_tokens: int
    block_ids: list[int]  # the request's whole block table
    # The tables of the other attention groups (layers of several windows: one per group after the
    # first, which is `block_ids`); () for a model with one.
    group_block_ids: tuple[list[int], ...] = ()
    num_computed_tokens: int = -1  # before this step; -1: read it from the request
    spec_token_ids: list[int] = field(default_factory=list)  # drafts verified by this step
    state_slot: int = 0  # a hybrid model's state slot for its linear-attention layers (0: none)
    # Copies between state slots around the step's forward (a prefix hit's snapshot in, a new snapshot
    # out: core/kv_cache_coordinator.py StateCopy); None: none.
    state_copy: StateCopy | None = None
    is_sampling: bool = field(init=False)  # the step reaches the last token, so it samples
    # Async scheduling: the last token this step computes was sampled by the step still in flight;
    # its id is read on the device from that step's sampled ids, at this row (-1: every id is known).
    prev_sampled_row: int = field(init=False)
    # Index among the request's outputs of the token this step samples (placeholders included): the
    # sampler's key and min_tokens read it.
    sample_index: int = field(init=False)
    # A pooling request whose prompt this step completes: the runner returns its pooled output.
    is_pooling: bool = field(init=False)

    def __post_init__(self):
        req = self.request
        if self.num_computed_tokens < 0:
            self.num_computed_tokens = req.num_computed_tokens
        end = self.num_computed_tokens + self.num_new_tokens
        num_known = req.num_tokens + len(self.spec_token_ids)  # drafts ride as known ids
        is_last = end == num_known + req.num_output_placeholders
        # A pooling request never samples (so never holds a placeholder): its last chunk pools.
        self.is_sampling = is_last and req.pooling_params is None
        self.is_pooling = is_last and req.pooling_params is not None
        self.prev_sampled_row = req.last_sampled_row if end > num_known else -1
        self.sample_index = req.num_output_tokens + req.num_output_placeholders

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def token_ids(self) -> list[int]:
        """The known token ids this step computes, drafts included (the last is missing when
        `prev_sampled_row` >= 0: async scheduling, which speculative decoding turns off)."""
        start, stop = self.num_computed_tokens, self.num_computed_tokens + self.num_new_tokens
        return self.request.all_token_ids[start : stop - len(self.spec_token_ids)] + self.spec_token_ids


@dataclass
class SchedulerOutput:
    """What one step computes, plus the requests dropped since the previous step."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)  # freed since the last step
    # The KV connector's transfers around this step (core/kv_connector.py); None: nothing to move.
    kv_connector_metadata: KVConnectorMetadata | None = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    """What the model runner returns for a step; logprob payloads pass through untouched."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # Speculative decoding: the drafts each verified request accepted, which precede its sampled id.
    accepted_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, Any] = field(default_factory=dict)
    prompt_logprobs: dict[str, Any] = field(default_factory=dict)
    # Speculative decoding with a draft model: the k tokens it proposed after each sampled id, which
    # the next step verifies (core/spec_decode.py's DraftModelProposer hands them to the scheduler).
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Requests whose part of the step's host work raised: the scheduler finishes them with an error.
    failed_req_ids: set[str] = field(default_factory=set)
    # Pooling requests whose prompt the step completed: their pooled output (a float32 vector, or a
    # [num_prompt_tokens, D] matrix for ALL pooling), as worker/pooler.py computed it.
    pooler_output: dict[str, Any] = field(default_factory=dict)
    # The KV connector's worker-side stats of the step (seconds spent moving blocks); None: no connector.
    kv_connector_stats: KVTransferStats | None = None


@dataclass
class EngineCoreOutput:
    """One request's news from one step, for the output processor."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    new_logprobs: Any = None
    new_prompt_logprobs: Any = None
    num_cached_tokens: int = 0
    num_external_computed_tokens: int = 0  # of the cached tokens, those a KV connector loaded
    num_cache_creation_tokens: int = 0  # the prompt's tokens it adds to the prefix cache
    # When it was first scheduled (time.time(); None before): the front end's queue, prefill and
    # inference times (vLLM's request_*_time_seconds).
    scheduled_time: float | None = None
    # Finished (STOP) because the last token completed the request's grammar: that token is text,
    # where a STOP otherwise ends on EOS or a stop token id, whose text is left out.
    is_grammar_complete: bool = False
    # A pooling request's result (it finishes with it): ModelRunnerOutput.pooler_output's.
    pooling_output: Any = None
    # A KV connector's, on the finished output (a producer's: where its prompt's blocks are served).
    kv_transfer_params: dict | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot for metrics; prefix-cache counters cover the time since the previous snapshot."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions_total: int
    prefix_cache_stats: PrefixCacheStats
    spec_decoding_stats: SpecDecodingStats | None = None  # since the previous snapshot; None: off
    kv_transfer_stats: KVTransferStats | None = None  # a KV connector's, since the previous one; None: off
    sleep_level: int = 0  # the engine's (EngineCore.sleep): 0 awake, 1 or 2 asleep at that level
