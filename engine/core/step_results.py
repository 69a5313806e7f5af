"""A step's results applied to its requests: the scheduler's half after the step.

`StepResults` is the part of the `Scheduler` (core/scheduler.py), which builds on it, that runs once a
step's `ModelRunnerOutput` is back: each scheduled request gets its sampled token (after the drafts it
accepted, rolled back over those it rejected), stops are checked, a pooling request finishes with its
pooled output, a failed one with an error, and a finished request's blocks are freed (reporting what a
KV connector attaches to its output). Under async scheduling a sampled token's placeholder is replaced
here, one step late (core/scheduler.py's module doc).
"""

from __future__ import annotations

from xlaserve.core.outputs import EngineCoreOutput, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from xlaserve.core.request import FinishReason, Request, RequestStatus
from xlaserve.core.stop import check_stop, is_grammar_complete


class StepResults:
    """The `Scheduler`'s methods after the step (module doc)."""

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, finish requests that stopped, and report what changed."""
        outputs, self._error_outputs = self._error_outputs, []
        self.kv_connector.update_connector_output(model_runner_output.kv_connector_stats)
        num_finished = 0
        for scheduled in scheduler_output.scheduled:
            request = scheduled.request
            if self.is_in_flight(request):  # (an aborted request's id may be in use again)
                del self._in_flight[request.request_id]
            if scheduled.state_copy is not None:  # the step ran: its state snapshot is written
                ran = request.request_id not in model_runner_output.failed_req_ids
                restore = not request.is_finished and _rejects_drafts(scheduled, model_runner_output)
                self.kv_cache_manager.settle_state_copy(
                    scheduled.state_copy, ran, request.request_id if restore else None
                )
            if request.is_finished:
                continue  # finished since the step was scheduled: what it sampled after is dropped
            if scheduled.is_sampling and self.async_scheduling:
                request.num_output_placeholders -= 1  # its real id, if any, is appended below
                if not request.num_output_placeholders:
                    request.last_sampled_row = -1
            # Async: a request preempted after this step was dispatched is WAITING; its token is
            # still valid and kept (it recomputes it), as the synchronous engine would have.
            request_id = request.request_id
            if request_id in model_runner_output.failed_req_ids:
                # Its rows were dummies (or their results unreadable): what this step was to write
                # into its blocks is not trusted, so those blocks leave the prefix cache.
                outputs.append(self._finish_with_error(request, scheduled.num_computed_tokens))
                num_finished += 1
                continue
            if scheduled.is_pooling:
                outputs.append(
                    self._finish_pooling(request, model_runner_output.pooler_output.get(request_id))
                )
                num_finished += 1
                continue
            # A request preempted after its prompt was done recomputes the prompt: its prompt
            # logprobs were already reported, so the repeat is dropped.
            has_reported_prompt = request.num_output_tokens > 0
            new_token_ids: list[int] = []
            if scheduled.is_sampling and request_id in model_runner_output.sampled_token_ids:
                new_token_ids = self._append_tokens(scheduled, model_runner_output)
            prompt_logprobs = None
            if not has_reported_prompt:
                prompt_logprobs = model_runner_output.prompt_logprobs.get(request_id)
            kv_transfer_params = None
            if request.is_finished:
                kv_transfer_params = self._free_request(request)
                num_finished += 1
            if new_token_ids or prompt_logprobs is not None:
                outputs.append(
                    EngineCoreOutput(
                        request_id,
                        new_token_ids,
                        finish_reason=request.get_finish_reason(),
                        stop_reason=request.stop_reason,
                        new_logprobs=_new_logprobs(model_runner_output, scheduled, len(new_token_ids)),
                        new_prompt_logprobs=prompt_logprobs,
                        num_cached_tokens=max(request.num_cached_tokens, 0),
                        num_external_computed_tokens=request.num_external_computed_tokens,
                        num_cache_creation_tokens=request.num_cache_creation_tokens,
                        scheduled_time=request.scheduled_time,
                        is_grammar_complete=is_grammar_complete(request),
                        kv_transfer_params=kv_transfer_params,
                    )
                )
        if num_finished:
            self.running = [r for r in self.running if not r.is_finished]
            self.waiting = [r for r in self.waiting if not r.is_finished]
        return outputs

    def _append_tokens(self, scheduled: ScheduledRequest, runner_output: ModelRunnerOutput) -> list[int]:
        """Append the step's tokens (accepted drafts, then the sampled one) up to the first that
        finishes the request; roll back over rejected drafts. Returns the tokens appended."""
        request, num_drafts = scheduled.request, len(scheduled.spec_token_ids)
        accepted = runner_output.accepted_token_ids.get(request.request_id, []) if num_drafts else []
        tokens = [*accepted, runner_output.sampled_token_ids[request.request_id]]
        num_appended = 0
        for token_id in tokens:  # tokens after a stop (or past max_tokens) are dropped
            request.append_output_token_ids(token_id)
            num_appended += 1
            check_stop(request, self.max_model_len)
            if request.is_finished:
                break
        if num_drafts:
            if _rejects_drafts(scheduled, runner_output):
                # The state ran past the rejected drafts: the state entering the step is restored
                # (settle_state_copy), and the step's tokens are computed again from it.
                request.num_computed_tokens = scheduled.num_computed_tokens
            else:  # the rejected drafts' K/V is not the request's: later steps overwrite those slots
                request.num_computed_tokens -= num_drafts - len(accepted)
            self.spec_decoding_stats.observe(num_drafts, len(accepted))
        return request.output_token_ids[-num_appended:]

    def _free_request(self, request: Request, num_valid_tokens: int | None = None) -> dict | None:
        """Free a finished request's blocks; returns the kv_transfer_params its output carries (a KV
        connector's, e.g. where a producer serves its prompt's blocks)."""
        request.num_output_placeholders, request.last_sampled_row = 0, -1  # in flight, they are dropped
        self.kv_cache_manager.free(request, num_valid_tokens=num_valid_tokens)
        self.encoder_cache.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)
        return self.kv_connector.request_finished(request)

    def _finish_with_error(self, request: Request, num_valid_tokens: int | None = None) -> EngineCoreOutput:
        """Fail one request (the others go on): free its blocks and return the news for its client."""
        request.status = RequestStatus.FINISHED_ERROR
        self._free_request(request, num_valid_tokens)
        return EngineCoreOutput(
            request.request_id,
            [],
            finish_reason=FinishReason.ERROR,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_cache_creation_tokens=request.num_cache_creation_tokens,
            scheduled_time=request.scheduled_time,
        )

    def _finish_pooling(self, request: Request, pooled) -> EngineCoreOutput:
        """A pooling request's prompt is computed: it finishes with its pooled output (an error if the
        runner returned none)."""
        if pooled is None:
            return self._finish_with_error(request)
        request.status = RequestStatus.FINISHED_STOPPED
        self._free_request(request)
        return EngineCoreOutput(
            request.request_id,
            [],
            finish_reason=FinishReason.STOP,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_cache_creation_tokens=request.num_cache_creation_tokens,
            scheduled_time=request.scheduled_time,
            pooling_output=pooled,
        )


def _rejects_drafts(scheduled: ScheduledRequest, runner_output: ModelRunnerOutput) -> bool:
    """A state model's request rejected a draft its step verified (its state holds the rejected ones)."""
    copy = scheduled.state_copy
    if copy is None or copy.backup is None or scheduled.request_id not in runner_output.sampled_token_ids:
        return False
    return len(runner_output.accepted_token_ids.get(scheduled.request_id, ())) < len(scheduled.spec_token_ids)


def _new_logprobs(model_runner_output: ModelRunnerOutput, scheduled: ScheduledRequest, num_tokens: int):
    """The logprobs of the tokens appended: passed through, or, after a verification (one entry per
    emitted token), those of the `num_tokens` kept."""
    entries = model_runner_output.logprobs.get(scheduled.request_id) if num_tokens else None
    return entries[:num_tokens] if entries is not None and scheduled.spec_token_ids else entries
