"""Preemption by recompute (vLLM V1's): the scheduler's answer when a running request's tokens get no
blocks.

`Preemption` is the part of the `Scheduler` (core/scheduler.py), which builds on it, that makes room:
the policy's victim (core/policy.py `pick_victim`: the last admitted, or the lowest priority) gives
back every block it holds and waits again at the head of its queue, to recompute its prompt and outputs
later (usually from its own cached prefix). A victim scheduled earlier in the same step is taken out of
it, and the token budget it held returns to the step. A step that preempts admits no waiting request.

Between steps every running request can be preempted at once (`preempt_running`: vLLM's
`reset_prefix_cache(reset_running_requests=True)`, which RL clients send after a weight update so that
no request goes on from K/V the old weights computed, and what a sleep that keeps its requests does).
A step still in flight then writes into blocks already given back: the steps run in order on the
device, so a later step that reuses them overwrites what it wrote.
"""

from __future__ import annotations

from xlaserve.core.outputs import SchedulerOutput
from xlaserve.core.policy import enqueue_waiting, pick_victim
from xlaserve.core.request import Request, RequestStatus


class Preemption:
    """The `Scheduler`'s preemption (module doc)."""

    def _allocate_or_preempt(
        self, request: Request, index: int, num_new_tokens: int, output: SchedulerOutput
    ) -> tuple[bool, int, int]:
        """Slots for `num_new_tokens` of running[index], preempting the policy's victims until they fit
        -> (whether it got them; its index now, where the next request slid in if it did not; the
        token budget the victims gave back). It gets none when it is the victim, or when it runs alone
        and still does not fit (then it fails: nothing else holds blocks, so waiting cannot help)."""
        num_returned_tokens = 0
        while self._allocate_slots(request, num_new_tokens) is None:
            if len(self.running) == 1:
                self.running.pop(index)
                self._error_outputs.append(self._finish_with_error(request))
                return False, index, num_returned_tokens
            victim_index = pick_victim(self.running, self.policy)
            victim = self.running[victim_index]
            num_returned_tokens += self._preempt(victim_index, output)
            if victim is request:
                return False, index, num_returned_tokens
            if victim_index < index:
                index -= 1
        return True, index, num_returned_tokens

    def preempt_running(self) -> int:
        """Preempt every running request (module doc), the last admitted first so that they wait again
        in their admission order; returns how many."""
        output = SchedulerOutput()
        while self.running:
            self._preempt(len(self.running) - 1, output)
        return len(output.preempted_req_ids)

    def _preempt(self, victim_index: int, output: SchedulerOutput) -> int:
        """Preempt running[victim_index] by recompute; returns the token budget it gives back."""
        victim = self.running.pop(victim_index)
        scheduled = next((s for s in output.scheduled if s.request is victim), None)
        num_valid_tokens = None
        num_returned_tokens = 0
        if scheduled is not None:
            # Scheduled earlier in this step (priority policy): its new K/V will never be written.
            output.scheduled.remove(scheduled)
            if scheduled.state_copy is not None:
                self.kv_cache_manager.settle_state_copy(scheduled.state_copy, ran=False)
            num_valid_tokens = scheduled.num_computed_tokens
            num_returned_tokens = scheduled.num_new_tokens
        self.kv_cache_manager.free(victim, num_valid_tokens=num_valid_tokens)
        self.encoder_cache.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.spec_token_ids = []
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions_total += 1
        output.preempted_req_ids.add(victim.request_id)
        enqueue_waiting(self.waiting, victim, self.policy, is_preempted=True)
        return num_returned_tokens
