"""What the steps in flight hold back: the scheduler's checks for async scheduling and pipeline
micro-batches (core/scheduler.py's module doc).

`StepsInFlight` is the part of the `Scheduler` (core/scheduler.py), which builds on it, that knows a
step in flight holds some requests' next ids: a micro-batch's requests are not scheduled again until
its output is applied, and each step takes its share of the requests; under async scheduling a request
whose tokens in flight reach its limits is not scheduled, and the engine waits for the step in flight
where a request's sampling reads its output ids on the host.
"""

from __future__ import annotations

from xlaserve.core.request import Request


class StepsInFlight:
    """The `Scheduler`'s checks of the steps in flight (module doc)."""

    def _max_seqs_this_step(self) -> int:
        """max_num_seqs; with micro-batches, this step's share of the requests (all in one step, the
        steps beside it would have nothing to run, and the stages nothing to overlap)."""
        if self.num_micro_batches == 1:
            return self.max_num_seqs
        num_requests = min(self.max_num_seqs, len(self.running) + len(self.waiting))
        return max(1, -(-num_requests // self.num_micro_batches))

    def is_in_flight(self, request: Request) -> bool:
        """In a micro-batch whose output is not applied yet: its next tokens are unknown."""
        return self._in_flight.get(request.request_id) is request

    def needs_known_tokens(self) -> bool:
        """Whether the step in flight must be finished before the next is scheduled: a running request
        with a token in flight samples under state built from its output ids on the host (penalty
        counts, a grammar's bitmask), which a placeholder would make wrong."""
        return any(
            r.num_output_placeholders and (r.grammar is not None or r.sampling_params.reads_output_tokens)
            for r in self.running
        )

    def _is_at_limit(self, request: Request) -> bool:
        """Its tokens in flight already reach max_tokens or max_model_len: one more step would sample
        a token the synchronous engine never samples (it would stop first)."""
        return request.num_output_placeholders > 0 and (
            request.num_output_tokens + request.num_output_placeholders >= request.max_tokens
            or request.num_tokens_with_placeholders >= self.max_model_len
        )
