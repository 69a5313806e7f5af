"""KV cache groups (core/kv_cache_spec.py, kv_cache_coordinator.py): a state group holds one slot per
request whatever its length and turns prefix caching off; a sliding-window group returns the blocks
that fell out of the window; several groups allocate all-or-nothing from one pool."""

from __future__ import annotations

import logging

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


def test_state_group_one_slot_per_request_and_no_prefix_cache(caplog):
    groups = (KVCacheGroup(StateSpec(BS), (0, 1)),)
    with caplog.at_level(logging.INFO):
        manager = KVCacheManager(BS, 4, True, max_model_len=64, kv_cache_groups=groups)
    assert not manager.enable_caching and "prefix caching is off" in caplog.text
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
