"""The slots speculative decoding adds to a request's step: the scheduler's side of it.

`DraftSlots` is the part of the `Scheduler` (core/scheduler.py), which builds on it, that gives a
decoding request's drafts (proposed the step before) slots to be verified in, and a draft model's
lookahead: up to `num_lookahead_tokens` slots past a step's tokens, where the drafter writes the K/V of
its proposals. Neither is ever at anyone's expense: drafts that do not fit the budget or the free
blocks are dropped (the step verifies fewer, or none), and a step without its lookahead still runs
(the draft model's later proposals are worse, never wrong).
"""

from __future__ import annotations

from xlaserve.core.request import Request


class DraftSlots:
    """The `Scheduler`'s slots for drafts (module doc)."""

    def _take_drafts(self, request: Request, num_missing: int, token_budget: int) -> list[int]:
        """The drafts a decoding request verifies this step, their slots allocated: as many as the
        budget and the free blocks allow (drafts never preempt anyone), else none."""
        spec_token_ids, request.spec_token_ids = request.spec_token_ids, []
        if num_missing != 1 or not spec_token_ids:
            return []
        spec_token_ids = spec_token_ids[: token_budget - 1]
        num_new_tokens = 1 + len(spec_token_ids)
        if (
            spec_token_ids
            and self._allocate_slots(request, num_new_tokens) is not None
            # A state model keeps the state entering the step, to restore if a draft is rejected.
            and self.kv_cache_manager.take_state_backup(request.request_id)
        ):
            return spec_token_ids
        return []

    def _allocate_slots(self, request: Request, num_new_tokens: int, hit_blocks=()):
        """`allocate_slots`, plus up to `num_lookahead_tokens` slots past the new tokens when the blocks
        are free and max_model_len allows (module doc)."""
        manager = self.kv_cache_manager
        if self.num_lookahead_tokens:
            end = request.num_computed_tokens + len(hit_blocks) * manager.block_size + num_new_tokens
            lookahead = min(self.num_lookahead_tokens, manager.max_blocks_per_seq * manager.block_size - end)
            if lookahead > 0:
                new_blocks = manager.allocate_slots(request, num_new_tokens, hit_blocks, lookahead)
                if new_blocks is not None:
                    return new_blocks
        return manager.allocate_slots(request, num_new_tokens, hit_blocks)
