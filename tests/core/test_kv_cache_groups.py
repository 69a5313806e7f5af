"""KV cache groups (core/kv_cache_spec.py, kv_cache_coordinator.py): a state group holds one slot per
request whatever its length, and caches prefixes through snapshots taken where a step ends on a block
boundary; a sliding-window group returns the blocks that fell out of the window; several groups
allocate all-or-nothing from one pool."""

from __future__ import annotations

import pytest

from xlaserve.core.kv_cache_manager import GroupedBlocks, KVCacheManager
from xlaserve.core.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheGroup,
    SlidingWindowSpec,
    StateSpec,
    context_blocks,
)
from xlaserve.core.request import Request
from xlaserve.sampling_params import SamplingParams

BS = 4


def request(rid: str, num_tokens: int) -> Request:
    return Request(rid, list(range(3, 3 + num_tokens)), SamplingParams(max_tokens=8))


def run(manager: KVCacheManager, req: Request, num_new: int) -> None:
    assert manager.allocate_slots(req, num_new) is not None
    req.num_computed_tokens += num_new


def test_state_group_one_slot_per_request():
    groups = (KVCacheGroup(StateSpec(BS), (0, 1)),)
    manager = KVCacheManager(BS, 4, False, max_model_len=64, kv_cache_groups=groups)
    first, second = request("a", 30), request("b", 30)
    run(manager, first, 13)  # a chunk of the prompt, then the rest, then decodes: one slot throughout
    assert manager.num_free_blocks == 2
    assert manager.get_block_ids("a") == [1] * 4  # the slot once per block_size tokens
    run(manager, first, 17)
    run(manager, first, 1)
    assert manager.num_free_blocks == 2 and manager.get_block_ids("a") == [1] * 8
    run(manager, second, 30)
    third = request("c", 5)
    assert manager.allocate_slots(third, 5) is not None
    fourth = request("d", 5)
    assert manager.allocate_slots(fourth, 5) is None  # 3 usable slots, 3 requests
    assert manager.get_computed_blocks(request("e", 30)) == ([], 0)
    for req in (first, second, third):
        manager.free(req)
    assert manager.num_free_blocks == 3 and not manager.req_to_blocks
    # Its context is not bounded by the pool: a request of max_model_len tokens needs one slot.
    assert manager.num_context_blocks == 64 // BS
    assert context_blocks(groups, 3, 64) == 16
    assert context_blocks((KVCacheGroup(FullAttentionSpec(BS), (0,)),), 3, 64) == 3


def test_sliding_window_returns_blocks_out_of_the_window():
    groups = (KVCacheGroup(SlidingWindowSpec(BS, sliding_window=6), (0,)),)
    manager = KVCacheManager(BS, 32, False, max_model_len=128, kv_cache_groups=groups)
    req = request("a", 40)
    run(manager, req, 16)  # positions 0..15: the next query (16) sees 11..16: blocks 0 and 1 are dead
    assert manager.num_free_blocks == 31 - 4
    run(manager, req, 1)
    assert manager.get_block_ids("a")[:2] == [0, 0]  # the null block keeps the table's positions
    assert manager.num_free_blocks == 31 - 5 + 2
    for _ in range(23):
        run(manager, req, 1)
    # 40 tokens: 10 blocks, of which only those of positions 34..39 (blocks 8, 9) are still read.
    assert sum(1 for b in manager.get_block_ids("a") if b) <= 3
    manager.free(req)
    assert manager.num_free_blocks == 31


def test_groups_allocate_together_from_one_pool():
    groups = (KVCacheGroup(FullAttentionSpec(BS), (0, 2)), KVCacheGroup(StateSpec(BS), (1, 3)))
    manager = KVCacheManager(BS, 8, False, max_model_len=64, kv_cache_groups=groups)
    req = request("a", 12)
    new = manager.allocate_slots(req, 12)
    assert isinstance(new, GroupedBlocks) and [len(g) for g in new.groups] == [3, 1]
    assert manager.num_free_blocks == 7 - 4
    attention, state = manager.get_group_block_ids("a")
    assert len(set(attention) | set(state)) == 4 and state == [state[0]] * 3
    assert manager.allocate_slots(request("b", 12), 12) is None  # needs 4, 3 free: nothing taken
    assert manager.num_free_blocks == 3
    manager.free(req)
    assert manager.num_free_blocks == 7


def test_group_block_size_must_match():
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(BS, 8, kv_cache_groups=(KVCacheGroup(FullAttentionSpec(8), (0,)),))


def prompt(rid: str, shared: int, num_tokens: int, tail: int) -> Request:
    """`shared` tokens every such prompt starts with, then its own (from `tail` on)."""
    return Request(rid, [*range(3, 3 + shared), *range(tail, tail + num_tokens - shared)], SamplingParams())


def prefill(manager: KVCacheManager, req: Request, hits=(), num_hit_tokens: int = 0):
    """One scheduled chunk as the scheduler makes it (cut by align_chunk), run at once: its state
    copies settled as the step's output would settle them. Returns (tokens, the StateCopy or None)."""
    num_new = manager.align_chunk(req, num_hit_tokens, req.num_tokens - num_hit_tokens)
    assert manager.allocate_slots(req, num_new, hits) is not None
    req.num_computed_tokens = num_hit_tokens + num_new
    copy = manager.take_state_copy(req.request_id)
    if copy is not None:
        manager.settle_state_copy(copy, ran=True)
    return num_new, copy


def test_state_snapshot_serves_a_later_prompt_of_a_state_only_model():
    """Mamba2's layout: slots are blocks of the shared pool. A 30-token prompt's chunk stops at 28 (the
    last boundary a later prompt can hit), where the live slot is copied into a snapshot; a prompt with
    the same 28 tokens then hits it: its own live slot, the snapshot copied in before its forward."""
    groups = (KVCacheGroup(StateSpec(BS), (0, 1)),)
    manager = KVCacheManager(BS, 8, True, max_model_len=64, kv_cache_groups=groups)
    first = prompt("a", 28, 30, 100)
    num_new, copy = prefill(manager, first)
    assert num_new == 28 and copy.copy_in is None
    live, snapshot = copy.copy_out
    assert manager.get_block_ids("a")[0] == live != snapshot
    assert manager.num_free_blocks == 7 - 1  # the snapshot is free, cached: evictable
    assert prefill(manager, first, num_hit_tokens=28)[0] == 2  # the rest: no second snapshot
    second = prompt("b", 28, 33, 200)
    hits, num_hit_tokens = manager.get_computed_blocks(second)
    assert num_hit_tokens == 28 and {b.block_id for b in hits} == {snapshot}
    num_new, copy = prefill(manager, second, hits, num_hit_tokens)
    assert num_new == 32 - 28 and copy.copy_in == (snapshot, manager.get_state_slot("b"))
    assert copy.copy_out is not None  # 32: its own last boundary
    third = prompt("c", 20, 30, 300)  # shares 20 tokens: no snapshot ends inside them
    assert manager.get_computed_blocks(third)[1] == 0
    for req in (first, second):
        manager.free(req)
    assert manager.num_free_blocks == 7


def test_hybrid_hit_is_cut_to_a_snapshot_and_the_branch_point_gets_one():
    """Attention blocks and a state pool of its own (2 live slots, 2 snapshot slots). Two prompts
    sharing 10 tokens: the second's attention hit (2 blocks) has no snapshot, so it hits nothing, and
    its prefill stops at the branch point (8) for a snapshot; a third prompt then hits 8 tokens in both
    groups. The attention blocks past the snapshot are recomputed, not hit."""
    groups = (
        KVCacheGroup(FullAttentionSpec(BS), (0, 2)),
        KVCacheGroup(StateSpec(BS, num_slots=5, num_snapshot_slots=2), (1, 3)),
    )
    manager = KVCacheManager(BS, 32, True, max_model_len=64, kv_cache_groups=groups)
    state_pool = manager.coordinator.state_manager.pool
    first, second, third = (prompt(rid, 10, 19, tail) for rid, tail in (("a", 100), ("b", 200), ("c", 300)))
    assert prefill(manager, first)[0] == 16
    hits, num_hit_tokens = manager.get_computed_blocks(second)
    assert num_hit_tokens == 0 and [len(g) for g in hits.groups] == [0, 0]
    num_new, copy = prefill(manager, second)
    assert num_new == 8 and copy.copy_out is not None
    assert prefill(manager, second, num_hit_tokens=8)[0] == 8  # on to its own last boundary, 16
    manager.free(first)
    manager.free(second)
    hits, num_hit_tokens = manager.get_computed_blocks(third)
    assert num_hit_tokens == 8 and [len(g) for g in hits.groups] == [2, 2]
    assert hits.groups[1][0].block_hash is not None and state_pool.get_num_free_blocks() == 4
    num_new, copy = prefill(manager, third, hits, num_hit_tokens)
    assert num_new == 8 and copy.copy_in[0] == hits.groups[1][0].block_id
    assert state_pool.get_num_free_blocks() == 3  # its live slot; the snapshots are free again


def test_snapshots_never_take_a_live_slot_and_unrun_ones_are_not_indexed():
    groups = (
        KVCacheGroup(FullAttentionSpec(BS), (0,)),
        KVCacheGroup(StateSpec(BS, num_slots=4, num_snapshot_slots=1), (1,)),
    )
    manager = KVCacheManager(BS, 32, True, max_model_len=64, kv_cache_groups=groups)
    first, second = prompt("a", 8, 9, 100), prompt("b", 4, 9, 200)
    assert manager.allocate_slots(first, 8) is not None
    copy = manager.take_state_copy("a")
    assert copy.copy_out is not None
    # The one spare slot holds a's snapshot until the step is settled: b's snapshot would take the live
    # slot a third request needs, so b takes none.
    assert manager.allocate_slots(second, 8) is not None and manager.take_state_copy("b") is None
    manager.settle_state_copy(copy, ran=False)  # a's rows failed: its snapshot is not indexed
    first.num_computed_tokens = 8
    assert manager.get_computed_blocks(prompt("c", 8, 9, 300))[1] == 0
    # Preempted before its step ran: the copies are dropped with the slots.
    manager.free(second)
    assert manager.allocate_slots(prompt("d", 8, 9, 400), 8) is not None
    copy = manager.take_state_copy("d")
    assert copy.copy_out is not None
    manager.settle_state_copy(copy, ran=True)
    assert manager.get_computed_blocks(prompt("e", 8, 9, 500))[1] == 8


def test_chunks_of_a_state_model_stop_at_the_last_boundary_of_the_prompt():
    groups = (KVCacheGroup(StateSpec(BS), (0,)),)
    manager = KVCacheManager(BS, 8, True, max_model_len=64, kv_cache_groups=groups)
    req = prompt("a", 0, 30, 100)
    assert manager.align_chunk(req, 0, 13) == 13  # no snapshot point inside: left as it is
    assert manager.align_chunk(req, 12, 3) == 3
    assert manager.align_chunk(req, 24, 6) == 4  # up to the last boundary before the last token
    assert manager.align_chunk(req, 0, 30) == 28
    assert manager.align_chunk(req, 28, 2) == 2
    with_prompt_logprobs = Request("b", list(range(30)), SamplingParams(prompt_logprobs=1))
    assert manager.align_chunk(with_prompt_logprobs, 0, 13) == 13  # never cached: never cut
    off = KVCacheManager(BS, 8, False, max_model_len=64, kv_cache_groups=groups)
    assert off.align_chunk(prompt("b", 0, 30, 100), 0, 13) == 13


def test_freed_live_slots_are_reused_before_a_snapshot_is_evicted():
    """Snapshots wait in the free queue (evictable); live slots freed after them go to its head, so
    new requests take those and the snapshots survive a full pool's turnover."""
    groups = (
        KVCacheGroup(FullAttentionSpec(BS), (0,)),
        KVCacheGroup(StateSpec(BS, num_slots=5, num_snapshot_slots=2), (1,)),
    )
    manager = KVCacheManager(BS, 64, True, max_model_len=64, kv_cache_groups=groups)
    first, second = prompt("a", 0, 9, 100), prompt("b", 0, 13, 200)
    for req in (first, second):
        prefill(manager, req)
    for req in (first, second):
        manager.free(req)
    for rid in ("c", "d"):  # two new live slots: the freed ones, not the snapshots
        assert manager.allocate_slots(prompt(rid, 0, 9, 300 + len(rid)), 4) is not None
    assert manager.get_computed_blocks(Request("f", first.prompt_token_ids + [9], SamplingParams()))[1] == 8
    assert manager.get_computed_blocks(Request("g", second.prompt_token_ids + [9], SamplingParams()))[1] == 12


def test_a_drafts_backup_is_restored_before_the_next_step_or_freed():
    """A step verifying drafts copies the live slot into a backup before its forward; a rejection
    hands the backup to the next step as a copy into the live slot, freed when that step settles. No
    spare slot: no backup, and the scheduler verifies no drafts."""
    groups = (
        KVCacheGroup(FullAttentionSpec(BS), (0,)),
        KVCacheGroup(StateSpec(BS, num_slots=4, num_snapshot_slots=1), (1,)),
    )
    manager = KVCacheManager(BS, 32, False, max_model_len=64, kv_cache_groups=groups)
    state_pool = manager.coordinator.state_manager.pool
    req = prompt("a", 0, 9, 100)
    run(manager, req, 9)
    live = manager.get_state_slot("a")
    assert manager.take_state_backup("a")
    copy = manager.take_state_copy("a")
    ((src, backup),) = copy.copies_before
    assert src == live and backup != live and copy.copy_out is None
    manager.settle_state_copy(copy, ran=True, restore_for="a")  # a draft rejected
    restore = manager.take_state_copy("a")
    assert restore.copies_before == [(backup, live)] and state_pool.get_num_free_blocks() == 1
    manager.settle_state_copy(restore, ran=True)
    assert state_pool.get_num_free_blocks() == 2
    run(manager, prompt("b", 0, 5, 200), 5)  # the last live slot
    assert manager.take_state_backup("b")  # the one spare slot
    assert not manager.take_state_backup("a") and manager.take_state_copy("a") is None


def gemma3_27b_windows() -> list[int | None]:
    """Gemma 3 27B's layers: 62, every sixth full attention, the others a window of 1,024."""
    return [None if (layer + 1) % 6 == 0 else 1024 for layer in range(62)]


def test_layers_of_several_windows_hold_a_window_each_at_8k():
    """Gemma 3 27B's groups (worker/kv_cache_groups.py window_groups): one full group of its ten global
    layers, six sliding groups; a request of 8,192 tokens (prefilled 512 at a time, then a decode)
    holds 513 blocks in the full group and 65 in each sliding one, of 10 layer pages each: 9,030 layer
    pages against one table's 62 x 513 = 31,806 (3.5x the requests at 8k in the same memory)."""
    from xlaserve.worker.kv_cache_groups import cache_layout, window_groups

    bs = 16
    groups = window_groups(gemma3_27b_windows(), bs)
    num_slots = cache_layout(groups).num_slots
    assert len(groups) == 7 and num_slots == 10
    manager = KVCacheManager(bs, 8192, False, max_model_len=16384, kv_cache_groups=groups)
    req = request("a", 8192)
    for _ in range(16):
        run(manager, req, 512)
    run(manager, req, 1)
    held = [sum(1 for b in ids if b) for ids in manager.get_group_block_ids("a")]
    assert held == [513] + [65] * 6
    assert sum(held) * num_slots == 9030
    assert manager.num_free_blocks == 8191 - sum(held)
    manager.free(req)
    assert manager.num_free_blocks == 8191


def test_the_context_of_several_groups_counts_a_window_per_sliding_group():
    full, window = FullAttentionSpec(16), SlidingWindowSpec(16, sliding_window=1024)
    groups = (KVCacheGroup(full, (5,)), *(KVCacheGroup(window, (i,)) for i in range(5)))
    # n + 5 * min(n, 65) <= 1,000 usable blocks: n = 675.
    assert context_blocks(groups, 1000, 65536) == 675
    assert context_blocks(groups, 100, 65536) == 100 // 6  # below a window, every group holds n
    # Sliding groups alone hold any length once their windows fit.
    assert context_blocks(groups[1:], 1000, 65536) == 4096


@pytest.mark.parametrize("window", [6, None])
def test_a_sliding_window_hit_needs_only_its_windows_blocks(window):
    """A later prompt hits the longest prefix whose next query's window is cached (vLLM's): a block
    evicted from the middle of a sliding group's prefix does not cut the hit, as it does under full
    attention; the blocks before the window are the null block, as in a running request's table."""
    spec = FullAttentionSpec(BS) if window is None else SlidingWindowSpec(BS, sliding_window=window)
    manager = KVCacheManager(BS, 32, True, max_model_len=128, kv_cache_groups=(KVCacheGroup(spec, (0,)),))
    first = request("a", 40)
    run(manager, first, 40)
    blocks = list(manager.get_blocks("a"))
    manager.free(first)
    manager.block_pool.uncache_blocks([blocks[3]])  # evicted
    later = request("b", 40)
    hits, num_hit_tokens = manager.get_computed_blocks(later)
    if window is None:
        assert num_hit_tokens == 12 and hits == blocks[:3]
        return
    # 9 blocks at most (the last token runs); the query at 36 sees 31..36: blocks 7 and 8.
    assert num_hit_tokens == 36
    assert [b.block_id for b in hits] == [0] * 7 + [blocks[7].block_id, blocks[8].block_id]
    num_free = manager.num_free_blocks
    assert manager.allocate_slots(later, 4, hits) is not None  # 2 hits and 1 new block taken
    assert manager.num_free_blocks == num_free - 3
    manager.free(later)
    assert manager.num_free_blocks == 31
