"""Stand-ins for the scheduler's ScheduledRequest where a test drives the model's forward directly."""

from __future__ import annotations

from types import SimpleNamespace


def prompt_chunk(ids, num_computed: int, num_new: int, block_ids, group_block_ids=()) -> SimpleNamespace:
    """Prompt tokens ids[num_computed : num_computed + num_new] of one sequence, as build_step_batch
    reads a ScheduledRequest: every id known (no async placeholder), no drafts. `group_block_ids`: the
    tables of the other attention groups (a model of several windows)."""
    ids = [int(i) for i in ids]
    return SimpleNamespace(
        request_id="prompt",
        request=SimpleNamespace(all_token_ids=ids),
        token_ids=ids[num_computed : num_computed + num_new],
        num_computed_tokens=num_computed,
        num_new_tokens=num_new,
        block_ids=list(block_ids),
        group_block_ids=tuple(list(table) for table in group_block_ids),
        state_slot=0,  # no state layers
        prev_sampled_row=-1,
    )
