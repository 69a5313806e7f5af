"""Continuous batching in vLLM V1's style: one token budget, no prefill or decode phase.

Each request only has `num_computed_tokens` and `num_tokens`. A step gives every scheduled
request some of its missing tokens within `max_num_batched_tokens`: one token for a request
that is decoding, a chunk of the prompt for one that is prefilling (long prompts are split
across steps), all in the same flat batch. Running requests are served first, in order; then
waiting ones are admitted while the budget, `max_num_seqs` and the free KV blocks allow.
When a running request cannot get blocks, another is preempted by recompute (core/preemption.py).
A decoding request's drafts, and a draft model's lookahead, get slots only where they fit
(core/draft_slots.py).

A waiting request's prompt may also be served past its device prefix hit by a KV connector (host
offload: core/kv_connector.py): those tokens get blocks, are loaded before the step and count as computed.

So that one long prompt cannot hold the others hostage, prefill chunks are capped and only a few
prompts are prefilled across steps at once (core/partial_prefills.py).

Async scheduling (vLLM V1's): step N+1 is scheduled while step N runs, so a token sampled in N is a
placeholder when N+1 is scheduled: it counts in `num_computed_tokens` and in
`num_tokens_with_placeholders`, its id is read on the device, and `update_from_output` of step N
replaces it with the real id one step late. Stops are therefore seen one step late too: what a
request sampled after its stop is dropped, and no request is scheduled past max_tokens or
max_model_len counting the tokens in flight. Block hashes only ever cover known ids.

Pipeline micro-batches (vLLM's batch queue; `num_micro_batches` > 1, engine/engine/core.py): up to that
many steps are in flight at once, each of other requests, so no step needs an id another one samples and
every id is known when a step is scheduled (no placeholders). A request in a step in flight is not
scheduled again until that step's output is applied, and each step takes its share of the requests
(ceil(requests / num_micro_batches)), so that the next has some left to run. What a step in flight
holds back: core/steps_in_flight.py.

What happens once a step's output is back (tokens appended, stops, finishes) is core/step_results.py's.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from xlaserve.core.draft_slots import DraftSlots
from xlaserve.core.encoder_cache_manager import EncoderCacheManager
from xlaserve.core.kv_cache_manager import KVCacheManager
from xlaserve.core.kv_connector import KVConnectorScheduler
from xlaserve.core.limits import RequestLimits
from xlaserve.core.outputs import EngineCoreOutput, ScheduledRequest, SchedulerOutput, SchedulerStats
from xlaserve.core.partial_prefills import Demands, PartialPrefills
from xlaserve.core.policy import SchedulingPolicy, enqueue_waiting
from xlaserve.core.preemption import Preemption
from xlaserve.core.request import Request, RequestStatus
from xlaserve.core.spec_decode import SpecDecodingStats
from xlaserve.core.step_results import StepResults
from xlaserve.core.steps_in_flight import StepsInFlight

# long_prefill_token_threshold=None caps a prefill chunk at this fraction of the step's budget: with
# the default max_num_partial_prefills=2, partial prefills take at most half of every step. That default
# is fairness to the other requests and no more: a prefill also takes the budget they leave
# (core/partial_prefills.py), so a prompt alone in the engine takes whole steps (vLLM's default).
DEFAULT_PREFILL_CHUNK_DIVISOR = 4


class Scheduler(StepResults, StepsInFlight, Preemption, DraftSlots):
    """Decides, each step, which requests compute how many tokens, and applies sampled tokens."""

    def __init__(
        self,
        scheduler_config,
        cache_config,
        max_model_len: int,
        kv_cache_manager: KVCacheManager,
        *,
        async_scheduling: bool = False,
        num_spec_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        max_loras: int | None = None,
        enable_chunked_prefill: bool = True,
        kv_connector: KVConnectorScheduler | None = None,
        encoder_cache: EncoderCacheManager | None = None,
        num_micro_batches: int = 1,
    ):
        if kv_cache_manager.block_size != cache_config.block_size:
            raise ValueError(
                f"kv_cache_manager.block_size ({kv_cache_manager.block_size}) must equal "
                f"cache_config.block_size ({cache_config.block_size})"
            )
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold
        self.spares_budget = self.long_prefill_token_threshold is None
        if self.spares_budget:
            self.long_prefill_token_threshold = self.max_num_batched_tokens // DEFAULT_PREFILL_CHUNK_DIVISOR
        self.max_num_partial_prefills = scheduler_config.max_num_partial_prefills
        self.max_long_partial_prefills = scheduler_config.max_long_partial_prefills
        self.policy = SchedulingPolicy(scheduler_config.policy)
        # Schedule while the previous step runs: its sampled tokens are placeholders (module doc).
        self.async_scheduling = async_scheduling
        self.max_loras = max_loras  # None: LoRA off, no limit
        # Off for an encoder-only model: each prompt runs whole in one step (it attends both ways).
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_model_len = max_model_len
        self.kv_cache_manager = kv_cache_manager
        # A state-only model's request holds one slot whatever its length: num_context_blocks says so.
        self.limits = RequestLimits(
            max_model_len, kv_cache_manager.block_size, kv_cache_manager.num_context_blocks
        )
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # in admission order (core/policy.py)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.num_preemptions_total = 0
        # Requests failed inside schedule(): reported by the next update_from_output.
        self._error_outputs: list[EngineCoreOutput] = []
        # Speculative decoding (k drafts at most per request and step; 0: off).
        self.num_spec_tokens = num_spec_tokens
        self.spec_decoding_stats = SpecDecodingStats(num_spec_tokens)
        # Slots past the scheduled tokens a step may write (a draft model's proposals: vLLM's name).
        self.num_lookahead_tokens = num_lookahead_tokens
        # K/V from outside the device cache (core/kv_connector.py); the base class: none.
        self.kv_connector = kv_connector or KVConnectorScheduler()
        # Images' encoder outputs on the device (core/encoder_cache_manager.py); none: a text-only model.
        self.encoder_cache = encoder_cache or EncoderCacheManager()
        # Steps in flight at once, each of other requests (module doc); 1: off.
        if num_micro_batches > 1 and async_scheduling:
            raise ValueError("num_micro_batches > 1 schedules known ids only: async_scheduling must be off")
        self.num_micro_batches = num_micro_batches
        # The requests of the micro-batches in flight (scheduled, their outputs not yet applied), by id.
        self._in_flight: dict[str, Request] = {}

    # -- requests in and out ------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError if it could never fit in max_model_len or the KV cache."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.limits.check(request.num_prompt_tokens, request.max_tokens)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        enqueue_waiting(self.waiting, request, self.policy, is_preempted=False)

    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """Finish (e.g. abort) requests from outside the step; unknown or finished ids are ignored."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finished_status must be a FINISHED_* status, got {finished_status!r}")
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = finished_status
            self._free_request(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    # -- the step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts; advances their num_computed_tokens."""
        output = SchedulerOutput(finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = set()
        self.encoder_cache.begin_step()
        prefills = PartialPrefills(
            self.max_num_partial_prefills,
            self.max_long_partial_prefills,
            self.long_prefill_token_threshold,
            spares_budget=self.spares_budget,
            is_whole=not self.enable_chunked_prefill,
        )
        max_seqs = self._max_seqs_this_step()
        demands = self._demands(max_seqs) if self.spares_budget else Demands()
        token_budget = self._schedule_running(output, prefills, max_seqs, demands)
        # After a preemption the blocks are short: admitting new work would only thrash.
        if not output.preempted_req_ids:
            self._schedule_waiting(output, token_budget, prefills, max_seqs, demands)
        output.total_num_scheduled_tokens = sum(s.num_new_tokens for s in output.scheduled)
        output.kv_connector_metadata = self.kv_connector.build_connector_meta(output.scheduled)
        if self.async_scheduling:
            # Rows are final only now (a preemption removes scheduled rows): each sampled token is a
            # placeholder until this step's output arrives, found on the device at its row.
            for row, scheduled in enumerate(output.scheduled):
                if scheduled.is_sampling:
                    scheduled.request.num_output_placeholders += 1
                    scheduled.request.last_sampled_row = row
        if self.num_micro_batches > 1:
            self._in_flight.update((s.request_id, s.request) for s in output.scheduled)
        return output

    def _demands(self, max_seqs: int) -> Demands:
        """What the requests this step may schedule (running, then the waiting queue's head) would take
        under the prefill cap: what a prefill leaves them."""
        threshold, demands = self.long_prefill_token_threshold, {}
        for request in self.running:
            num_missing = request.num_tokens_with_placeholders - request.num_computed_tokens
            if num_missing > 0 and not self.is_in_flight(request):
                is_decode = num_missing == 1
                demands[request.request_id] = (
                    1 + len(request.spec_token_ids) if is_decode else min(num_missing, threshold)
                )
        for request in self.waiting[: max(0, max_seqs - len(demands))]:
            demands[request.request_id] = min(request.num_tokens - request.num_computed_tokens, threshold)
        return Demands(demands)

    def _schedule_running(
        self, output: SchedulerOutput, prefills: PartialPrefills, max_seqs: int, demands: Demands
    ) -> int:
        token_budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and token_budget > 0 and len(output.scheduled) < max_seqs:
            request = self.running[index]
            if self.is_in_flight(request):
                index += 1
                continue
            num_missing = request.num_tokens_with_placeholders - request.num_computed_tokens
            reserve = demands.after(request.request_id)
            num_new_tokens = prefills.chunk(num_missing, token_budget, reserve) if num_missing > 0 else 0
            num_new_tokens = self.kv_cache_manager.align_chunk(
                request, request.num_computed_tokens, num_new_tokens
            )
            if self._is_at_limit(request):
                num_new_tokens = 0
            num_new_tokens = self.encoder_cache.fit(
                request, request.num_computed_tokens, num_new_tokens, token_budget
            )
            if num_new_tokens <= 0:
                index += 1
                continue
            spec_token_ids = self._take_drafts(request, num_missing, token_budget)
            num_new_tokens += len(spec_token_ids)
            is_allocated, index, num_returned_tokens = self._allocate_or_preempt(
                request, index, num_new_tokens, output
            )
            token_budget += num_returned_tokens
            if not is_allocated:
                continue  # preempted itself, or failed: the next request slid into `index`
            self.encoder_cache.allocate(request, request.num_computed_tokens, num_new_tokens)
            prefills.add(num_missing, num_new_tokens)
            token_budget -= self._add_scheduled(request, num_new_tokens, output, spec_token_ids)
            index += 1
        return token_budget

    def _schedule_waiting(
        self,
        output: SchedulerOutput,
        token_budget: int,
        prefills: PartialPrefills,
        max_seqs: int,
        demands: Demands,
    ) -> None:
        index = 0  # requests before it wait for their grammar to compile, or their prefill turn
        while (
            index < len(self.waiting)
            and token_budget > 0
            and len(self.running) < self.max_num_seqs
            and len(output.scheduled) < max_seqs
        ):
            request = self.waiting[index]
            # Preempted with a token in flight (async: never the case once that step's output is
            # applied, which happens before the next schedule; micro-batches: until its step's output
            # is applied): recomputing needs the real id.
            if (
                request.num_output_placeholders
                or self.is_in_flight(request)
                or (request.grammar is not None and not request.grammar.is_ready)
            ):
                index += 1
                continue
            if request.grammar is not None and request.grammar.error is not None:
                self.waiting.pop(index)
                self._error_outputs.append(self._finish_with_error(request))
                continue
            if not self._fits_lora_slots(request):
                index += 1  # its adapter waits for a slot; a request of a running adapter may go
                continue
            hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            # Tokens after the device hit that a connector loads before the step (host offload): they
            # get blocks like the tokens computed, and count as computed.
            num_external = self.kv_connector.get_num_new_matched_tokens(request, num_hit_tokens)
            num_missing = request.num_tokens - num_hit_tokens - num_external
            num_new_tokens = prefills.chunk(num_missing, token_budget, demands.after(request.request_id))
            num_new_tokens = self.kv_cache_manager.align_chunk(
                request, request.num_tokens - num_missing, num_new_tokens
            )
            num_new_tokens = self.encoder_cache.fit(
                request, request.num_tokens - num_missing, num_new_tokens, token_budget
            )
            if num_new_tokens == 0:
                index += 1  # the partial-prefill slots are taken: a shorter prompt behind may fit whole
                continue
            if self._allocate_slots(request, num_external + num_new_tokens, hit_blocks) is None:
                if not self.running:
                    # No request holds a block, yet this one does not fit: it never will.
                    self.waiting.pop(index)
                    self._error_outputs.append(self._finish_with_error(request))
                    continue
                break  # head-of-line: later requests wait their turn
            self.waiting.pop(index)
            self.encoder_cache.allocate(request, request.num_tokens - num_missing, num_new_tokens)
            prefills.add(num_missing, num_new_tokens)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            self.kv_connector.update_state_after_alloc(
                request, self.kv_cache_manager.get_block_ids(request.request_id), num_hit_tokens, num_external
            )
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens + num_external
                request.num_external_computed_tokens = num_external
                request.num_cache_creation_tokens = max(
                    self.kv_cache_manager.num_cacheable_tokens(request) - request.num_cached_tokens, 0
                )
                request.scheduled_time = time.time()
            request.num_computed_tokens = num_hit_tokens + num_external
            token_budget -= self._add_scheduled(request, num_new_tokens, output)

    def num_local_prefix_tokens(self, request: Request) -> int:
        """How many of a waiting request's leading tokens this engine holds now: its device prefix hit,
        and what a connector holds after it (the host tier; a producer's blocks are not attached yet).
        A consumer fetches only the blocks after them (engine/engine/kv_fetch.py)."""
        num_hit_tokens = self.kv_cache_manager.num_cached_tokens(request)
        return num_hit_tokens + self.kv_connector.get_num_new_matched_tokens(request, num_hit_tokens)

    def _fits_lora_slots(self, request: Request) -> bool:
        """At most `max_loras` adapters among the running requests, each holding a device slot while
        it runs: a request of another adapter waits until one of them has no request left."""
        if self.max_loras is None or request.lora_request is None:
            return True
        active = {r.lora_id for r in self.running if r.lora_request is not None}
        return request.lora_id in active or len(active) < self.max_loras

    def _add_scheduled(
        self, request: Request, num_new_tokens: int, output: SchedulerOutput, spec_token_ids=()
    ) -> int:
        manager = self.kv_cache_manager
        block_ids = manager.get_block_ids(request.request_id)
        output.scheduled.append(
            ScheduledRequest(
                request,
                num_new_tokens,
                block_ids,
                group_block_ids=manager.get_window_block_ids(request.request_id),
                spec_token_ids=list(spec_token_ids),
                state_slot=manager.get_state_slot(request.request_id),
                state_copy=manager.take_state_copy(request.request_id),
            )
        )
        # Advanced now, not after the step: the K/V is as good as written once scheduled.
        request.num_computed_tokens += num_new_tokens
        return num_new_tokens

    # -- metrics ------------------------------------------------------------------------------

    def make_stats(self) -> SchedulerStats:
        """Current gauges, and prefix-cache counters since the previous call."""
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            num_preemptions_total=self.num_preemptions_total,
            prefix_cache_stats=self.kv_cache_manager.make_prefix_cache_stats(),
            spec_decoding_stats=self._take_spec_decoding_stats(),
            kv_transfer_stats=self.kv_connector.make_stats(),
        )

    def _take_spec_decoding_stats(self) -> SpecDecodingStats | None:
        if not self.num_spec_tokens:
            return None
        stats, self.spec_decoding_stats = self.spec_decoding_stats, SpecDecodingStats(self.num_spec_tokens)
        return stats

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix, on the device and in a connector's tier; with
        `reset_running_requests`, the running requests' K/V too: they are preempted first and recompute
        (core/preemption.py `preempt_running`)."""
        if reset_running_requests:
            self.preempt_running()
        self.kv_connector.reset()
        return self.kv_cache_manager.reset_prefix_cache()
