"""Stand-ins for the scheduler's ScheduledRequest where a test drives the model's forward directly."""

from __future__ import annotations

from types import SimpleNamespace


def prompt_chunk(ids, num_computed: int, num_new: int, block_ids) -> SimpleNamespace:
    """Prompt tokens ids[num_computed : num_computed + num_new] of one sequence, as build_step_batch
    reads a ScheduledRequest: every id known (no async placeholder), no drafts."""
    ids = [int(i) for i in ids]
    return SimpleNamespace(
        request_id="prompt",
        request=SimpleNamespace(all_token_ids=ids),
        token_ids=ids[num_computed : num_computed + num_new],
        num_computed_tokens=num_computed,
        num_new_tokens=num_new,
        block_ids=list(block_ids),
        state_slot=0,  # no state layers
        prev_sampled_row=-1,
    )
