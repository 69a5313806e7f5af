"""Host offload's scheduler half (issue 35): the host tier's LRU index and the transfer plans built from
the device cache's evictions (host only, no jax)."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os

import numpy as np
import pytest

from xlaserve.config import EngineConfig
from xlaserve.core.kv_cache_manager import KVCacheManager
from xlaserve.core.kv_events import BlockRemoved, BlockStored
from xlaserve.core.kv_offload import (
    GIB,
    HostBlockIndex,
    OffloadingConnectorScheduler,
    num_host_blocks,
    persistent_tier_dir,
)
from xlaserve.core.request import Request
from xlaserve.sampling_params import SamplingParams

BLOCK_SIZE = 4
_request_ids = itertools.count()


def _request(tokens, salt=None) -> Request:
    return Request(f"r{next(_request_ids)}", tokens, SamplingParams(max_tokens=4), cache_salt=salt)


def test_index_is_a_bounded_lru_that_spares_pinned_slots():
    index = HostBlockIndex(3)
    slots = [index.allocate(h) for h in (b"a", b"b", b"c")]
    assert sorted(slots) == [0, 1, 2]
    assert index.allocate(b"z") is None  # slots written this step are pinned too: none twice a step
    index.unpin_all()
    assert index.take_for_load(b"a") == slots[0]  # most recently used now, and pinned
    assert index.allocate(b"d") == slots[1]  # b: the least recently used
    assert b"b" not in index and len(index) == 3 and index.num_evicted == 1
    index.take_for_load(b"c")
    index.take_for_load(b"d")
    assert index.allocate(b"e") is None  # every slot pinned: the save is dropped, nothing overwritten
    index.unpin_all()
    assert index.allocate(b"e") == slots[0]  # a
    assert index.num_leading_hits([b"c", b"d", b"a", b"e"]) == 2


def test_size_in_blocks_and_a_size_too_small_is_named():
    assert num_host_blocks(1.0, 2**20) == 1024
    with pytest.raises(ValueError, match=r"kv_offloading_size \(1e-09 GiB\) holds no KV block"):
        num_host_blocks(1e-9, 4096)
    assert GIB == 2**30


def _setup(num_host=8, num_blocks=7):
    connector = OffloadingConnectorScheduler(num_host, BLOCK_SIZE, bytes_per_block=100)
    manager = KVCacheManager(BLOCK_SIZE, num_blocks, True, 64, on_evict=connector.on_block_evicted)
    return connector, manager


def _fill(manager, request):
    """Compute the request's prompt (as a scheduler would), then finish it."""
    manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens) is not None
    request.num_computed_tokens = request.num_tokens
    manager.free(request)


def _host_hit(connector, manager, request) -> int:
    """What the scheduler asks: the device hit (which hashes the request's blocks), then the host's."""
    _, num_hit = manager.get_computed_blocks(request)
    return connector.get_num_new_matched_tokens(request, num_hit)


def test_evicted_blocks_are_planned_as_saves_and_hits_come_back_as_loads():
    connector, manager = _setup()
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks
    _fill(manager, _request(prompt))
    assert connector.build_connector_meta([None]) is None  # nothing evicted yet
    _fill(manager, _request(list(range(50, 73))))  # 6 blocks: evicts all three
    assert connector.build_connector_meta([]) is None  # an empty step keeps its saves for the next
    meta = connector.build_connector_meta([None])
    assert len(meta.save_block_ids) == 3 and len(set(meta.save_slots.tolist())) == 3

    again = _request(prompt)
    hit_blocks, num_hit = manager.get_computed_blocks(again)
    assert num_hit == 0  # gone from the device
    assert connector.get_num_new_matched_tokens(again, 0) == 12
    assert _host_hit(connector, manager, _request(prompt, salt="other")) == 0
    assert _host_hit(connector, manager, _request(prompt[:8])) == 4  # 8 would leave no token to compute
    assert _host_hit(connector, manager, _request(prompt[:9])) == 8
    # Prompt logprobs need every position's logits: hashed (as after a preemption), still no hit.
    wants_logprobs = Request("lp", prompt, SamplingParams(max_tokens=4, prompt_logprobs=1))
    wants_logprobs.block_hashes[:] = again.block_hashes
    assert connector.get_num_new_matched_tokens(wants_logprobs, 0) == 0
    saved_slots = meta.save_slots.tolist()
    manager.allocate_slots(again, 13)  # evicts the second prompt's blocks: saved in this step's plan
    connector.update_state_after_alloc(again, manager.get_block_ids(again.request_id), 0, 12)
    meta = connector.build_connector_meta([None])
    assert meta.load_block_ids.tolist() == manager.get_block_ids(again.request_id)[:3]
    # The slots the first saves wrote are the ones the loads read, and the new saves take others.
    assert sorted(meta.load_slots.tolist()) == sorted(saved_slots)
    assert not set(meta.save_slots.tolist()) & set(saved_slots)
    manager.free(again)
    stats = connector.make_stats()
    assert (stats.num_hits, stats.num_queries, stats.bytes_saved, stats.bytes_loaded) == (12, 13, 600, 300)


def test_a_block_already_on_the_host_is_not_saved_again_and_reset_forgets():
    connector, manager = _setup()
    prompt = list(range(10, 23))
    _fill(manager, _request(prompt))
    _fill(manager, _request(list(range(50, 73))))
    connector.build_connector_meta([None])
    # Loaded back, computed on, finished, and evicted again: the host copy is touched, not rewritten.
    again = _request(prompt)
    manager.get_computed_blocks(again)
    manager.allocate_slots(again, 13)
    connector.update_state_after_alloc(again, manager.get_block_ids(again.request_id), 0, 12)
    connector.build_connector_meta([None])
    host_slots = [connector.index.slot_of[h] for h in again.block_hashes[:3]]
    manager.free(again)
    _fill(manager, _request(list(range(80, 103))))  # evicts the prompt's blocks again
    meta = connector.build_connector_meta([None])
    assert [connector.index.slot_of[h] for h in again.block_hashes[:3]] == host_slots
    assert not set(meta.save_slots.tolist()) & set(host_slots)
    connector.reset()
    assert len(connector.index) == 0
    assert _host_hit(connector, manager, _request(prompt)) == 0


def test_two_loads_into_one_block_in_a_step_keep_the_later():
    connector, _ = _setup()
    for h in (b"x", b"y"):
        connector.index.allocate(h)
    request = _request(list(range(8)))
    request.block_hashes[:] = [b"x"]
    connector.update_state_after_alloc(request, [5, 6], 0, 4)
    request.block_hashes[:] = [b"y"]
    connector.update_state_after_alloc(request, [5, 6], 0, 4)
    meta = connector.build_connector_meta([None])
    assert meta.load_block_ids.tolist() == [5]
    assert meta.load_slots.tolist() == [connector.index.slot_of[b"y"]]
    assert np.asarray(meta.save_block_ids).size == 0


def test_the_disk_tier_takes_what_the_host_tier_evicts_and_serves_hits_in_order():
    """Host tier of 2 blocks, disk tier of 4: the host tier's least recently used block is demoted
    (host slot -> disk slot, planned before the save that reuses the host slot), a hit reads each block
    from the tier that holds it, and a block saved in the same step is never demoted (its bytes are not
    on the host yet)."""
    connector = OffloadingConnectorScheduler(2, BLOCK_SIZE, bytes_per_block=100, num_disk_blocks=4)
    metas = []
    for block_hash, block_id in ((b"a", 1), (b"b", 2), (b"c", 3)):  # one eviction a step
        connector.on_block_evicted(block_hash, block_id)
        metas.append(connector.build_connector_meta([None]))
    slot_a = metas[0].save_slots.tolist()[0]
    assert metas[1].demote_host_slots.size == 0
    assert metas[2].demote_host_slots.tolist() == [slot_a] and metas[2].save_slots.tolist() == [slot_a]
    assert metas[2].demote_disk_slots.tolist() == [connector.disk.slot_of[b"a"]]
    assert b"a" not in connector.index and b"b" in connector.index and b"c" in connector.index

    request = _request(list(range(13)))
    request.block_hashes[:] = [b"a", b"b", b"c"]
    assert connector.get_num_new_matched_tokens(request, 0) == 12  # a from disk, b and c from the host
    request.block_hashes[:] = [b"a", b"x", b"c"]
    assert connector.get_num_new_matched_tokens(request, 0) == 4  # leading hits only
    request.block_hashes[:] = [b"a", b"b", b"c"]
    connector.update_state_after_alloc(request, [4, 5, 6, 7], 0, 12)
    meta = connector.build_connector_meta([None])
    assert meta.disk_load_block_ids.tolist() == [4]
    assert meta.disk_load_slots.tolist() == [connector.disk.slot_of[b"a"]]
    assert dict(zip(meta.load_block_ids.tolist(), meta.load_slots.tolist())) == {
        5: connector.index.slot_of[b"b"],
        6: connector.index.slot_of[b"c"],
    }
    stats = connector.make_stats()
    assert (stats.num_hits, stats.num_disk_hits) == (12, 4)
    assert (stats.num_blocks_demoted, stats.bytes_demoted, stats.bytes_loaded_from_disk) == (1, 100, 100)
    # Evicted from the device again: a block a tier holds is touched, not saved or demoted again.
    connector.on_block_evicted(b"a", 4)
    assert connector.build_connector_meta([None]) is None

    # Three saves in one step for two slots: one slot each, the last evicted kept (a prefix's head),
    # nothing demoted (no slot's bytes are on the host yet).
    fresh = OffloadingConnectorScheduler(2, BLOCK_SIZE, bytes_per_block=100, num_disk_blocks=4)
    for block_hash, block_id in ((b"a", 1), (b"b", 2), (b"c", 3)):  # all in one step
        fresh.on_block_evicted(block_hash, block_id)
    meta = fresh.build_connector_meta([None])
    assert meta.save_block_ids.tolist() == [2, 3] and sorted(meta.save_slots.tolist()) == [0, 1]
    assert dict(zip(meta.save_slots.tolist(), (b"b", b"c"))) == {s: h for h, s in fresh.index.slot_of.items()}
    assert meta.demote_host_slots.size == 0 and b"a" not in fresh.disk and len(fresh.index) == 2
    assert fresh.make_stats().num_saves_skipped == 1  # a: counted (xlaserve:kv_offload_stores_skipped)
    # Two demotions in one step for one disk slot: the first takes it, the second is dropped.
    small = OffloadingConnectorScheduler(2, BLOCK_SIZE, bytes_per_block=100, num_disk_blocks=1)
    for step in ((b"a", b"b"), (b"c", b"d")):
        for block_id, block_hash in enumerate(step, 1):
            small.on_block_evicted(block_hash, block_id)
        meta = small.build_connector_meta([None])
    assert meta.demote_host_slots.tolist() == [0] and meta.demote_disk_slots.tolist() == [0]
    assert dict(small.disk.slot_of) == {b"a": 0}
    assert small.make_stats().num_demotes_skipped == 1  # b (xlaserve:kv_offload_demotions_skipped)
    connector.reset()
    assert len(connector.disk) == 0 and connector.get_num_new_matched_tokens(request, 0) == 0


def _digest(i: int) -> bytes:
    return hashlib.sha256(bytes([i])).digest()  # block hashes are SHA-256 digests


def _persistent(folder, num_host=2, num_disk=4, **kwargs) -> OffloadingConnectorScheduler:
    for name in ("0.kv", "1.kv"):  # the worker's files, whole: two arrays of half a block each
        with open(os.path.join(folder, name), "wb") as f:
            f.truncate(num_disk * 8)
    return OffloadingConnectorScheduler(num_host, BLOCK_SIZE, 16, num_disk, persist_dir=str(folder), **kwargs)


def test_a_persistent_tier_keeps_the_newest_blocks_locked_while_it_runs(tmp_path):
    """At shutdown: the host tier's blocks, then the device's, as many as the disk holds, the most recent
    kept; the next scheduler on the directory starts with them (least recently used first) and takes the
    index file; a second one while it runs is refused by name; after a reset nothing is kept."""
    first = _persistent(tmp_path)
    first.index.allocate(_digest(0))  # host slot 0
    first.index.allocate(_digest(1))  # host slot 1
    device = [(_digest(i), 10 + i) for i in (1, 2, 3, 4)]  # digest 1 is on the host: not saved twice
    plan = first.shutdown_plan(device)
    # 5 blocks wanted (host 0, 1; device 2, 3, 4) for 4 disk slots: the oldest, host slot 0, left out.
    assert plan.demote_host_slots.tolist() == [1] and plan.demote_disk_slots.tolist() == [0]
    assert plan.disk_save_block_ids.tolist() == [12, 13, 14]
    assert plan.disk_save_slots.tolist() == [1, 2, 3]
    first.shut_down()
    assert first.shutdown_plan(device) is None  # shut down: nothing more
    assert os.path.exists(tmp_path / "index.npz")

    second = _persistent(tmp_path)
    assert not os.path.exists(tmp_path / "index.npz")  # dying now, it would leave the next one empty
    assert list(second.disk.slot_of.items()) == [(_digest(i), i - 1) for i in (1, 2, 3, 4)]
    assert second.disk.num_used == 4
    with pytest.raises(ValueError, match="persistent tier .* is in use by another engine"):
        _persistent(tmp_path)
    second.reset()
    assert second.shutdown_plan(device) is None
    second.shut_down()
    assert not os.path.exists(tmp_path / "index.npz")  # the weights may have changed: nothing kept
    assert len(_persistent(tmp_path).disk) == 0


def test_a_persistent_tier_with_files_not_whole_starts_empty(tmp_path):
    first = _persistent(tmp_path)
    first.shutdown_plan([(_digest(5), 3)])
    first.shut_down()
    with open(tmp_path / "1.kv", "wb") as f:
        f.truncate(8)  # cut short
    second = OffloadingConnectorScheduler(2, BLOCK_SIZE, 16, 4, persist_dir=str(tmp_path))
    assert len(second.disk) == 0 and not os.path.exists(tmp_path / "index.npz")


def test_the_persistent_tiers_directory_is_named_by_what_the_blocks_depend_on(tmp_path):
    base = {
        "kv_offloading_size": 1,
        "kv_offloading_disk_path": str(tmp_path),
        "kv_offloading_disk_persist": True,
    }
    name = persistent_tier_dir(EngineConfig.from_kwargs(**base), 4608)
    assert os.path.dirname(name) == str(tmp_path) and name == persistent_tier_dir(
        EngineConfig.from_kwargs(**base), 4608
    )
    others = [
        persistent_tier_dir(EngineConfig.from_kwargs(**base, dtype="float32"), 4608),
        persistent_tier_dir(EngineConfig.from_kwargs(**base, block_size=32), 4608),
        persistent_tier_dir(EngineConfig.from_kwargs(**base, tensor_parallel_size=2), 4608),
        persistent_tier_dir(EngineConfig.from_kwargs(**base), 2304),
    ]
    assert len({name, *others}) == 5
    assert (
        persistent_tier_dir(EngineConfig.from_kwargs(**{**base, "kv_offloading_disk_persist": False}), 1)
        is None
    )
    # Its core may take long to stop (it writes the cached blocks out first): the front end waits for it.
    assert (
        EngineConfig.from_kwargs(**base).core_shutdown_timeout_s,
        EngineConfig.from_kwargs().core_shutdown_timeout_s,
    ) == (
        300.0,
        5.0,
    )
    with pytest.raises(ValueError, match="kv_offloading_disk_persist needs kv_offloading_disk_path"):
        EngineConfig.from_kwargs(kv_offloading_size=1, kv_offloading_disk_persist=True)
    # Data-parallel ranks: each its own directory (index, files, lock); rank 0's is a single engine's.
    dp = EngineConfig.from_kwargs(**base, data_parallel_size=2)
    rank1 = dataclasses.replace(dp, parallel=dataclasses.replace(dp.parallel, data_parallel_rank=1))
    assert persistent_tier_dir(dp, 4608) == name and persistent_tier_dir(rank1, 4608) == f"{name}-dp1"


def test_the_host_tiers_stores_and_evictions_are_kv_cache_events():
    """vLLM's offloading connector's events (medium "CPU", hashes only), in the order the tier changed."""
    connector = OffloadingConnectorScheduler(2, BLOCK_SIZE, bytes_per_block=100, enable_kv_cache_events=True)
    manager = KVCacheManager(BLOCK_SIZE, 7, True, 64, on_evict=connector.on_block_evicted)
    first = _request(list(range(10, 23)))  # 3 full blocks
    _fill(manager, first)
    _fill(manager, _request(list(range(50, 73))))  # evicts the first's three, tail first
    assert connector.take_events() == []  # saves are planned with the step
    connector.build_connector_meta([None])
    a0, a1, a2 = (int.from_bytes(h[-8:], "big") for h in first.block_hashes)

    def stored(hashes):
        return BlockStored(hashes, None, [], 0, lora_id=None, medium="CPU", lora_name=None)

    # Two slots for three saves: the tail's is skipped (no save of a step evicts another of it).
    assert connector.take_events() == [stored([a1, a0])]
    assert connector.make_stats().num_saves_skipped == 1
    assert connector.take_events() == []
    connector.on_block_evicted(_digest(9), 1)  # a step later: the least recently saved makes room
    connector.build_connector_meta([None])
    x = int.from_bytes(_digest(9)[-8:], "big")
    assert connector.take_events() == [BlockRemoved([a1], medium="CPU"), stored([x])]
    _fill(manager, _request(list(range(80, 103))))
    assert connector.build_connector_meta([None]) is not None  # more stores and evictions, then a reset:
    connector.reset()  # the device cache's AllBlocksCleared covers the tier, so nothing pending is sent
    assert connector.take_events() == []
    off = OffloadingConnectorScheduler(2, BLOCK_SIZE, bytes_per_block=100)
    assert off._changes is None and off.index.on_evict is None and off.take_events() == []


def _u64(key: bytes) -> int:
    return int.from_bytes(key[-8:], "big")  # the hash a router sees (core/kv_events.py)


def test_the_disk_tiers_changes_are_kv_cache_events_a_replay_follows(tmp_path):
    """vLLM's medium for its file-system tier, "STORAGE": a demotion is the host tier's BlockRemoved and
    the disk tier's BlockStored, the disk tier's eviction its BlockRemoved; a disk hit changes no tier
    (nothing); a persistent tier's last copies at shutdown are stored, and the next engine's start-up
    stores what it found. Replayed per medium, the events leave exactly the hashes each tier holds. The
    disk tier's say where it is and which it is (vLLM's locality and ownership of a secondary tier's
    events), the host tier's neither (vLLM's CPU tier's)."""
    held = {"CPU": set(), "STORAGE": set()}
    disk = {"locality": "LOCAL", "ownership": "fs"}

    def take(connector):
        events = connector.take_events()
        for event in events:
            tier = held[event.medium]
            if isinstance(event, BlockStored):
                tier.update(event.block_hashes)
            else:
                tier.difference_update(event.block_hashes)
        assert held == {
            "CPU": {_u64(h) for h in connector.index.slot_of},
            "STORAGE": {_u64(h) for h in connector.disk.slot_of},
        }
        return events

    def stored(hashes, medium="STORAGE"):
        where = disk if medium == "STORAGE" else {}
        return BlockStored(hashes, None, [], 0, lora_id=None, medium=medium, lora_name=None, **where)

    def removed(hashes, medium="STORAGE"):
        return BlockRemoved(hashes, medium=medium, **(disk if medium == "STORAGE" else {}))

    first = _persistent(tmp_path, num_host=2, num_disk=2, enable_kv_cache_events=True)
    d = [_digest(i) for i in range(6)]
    u = [_u64(h) for h in d]
    steps = []
    for i in range(5):  # one save a step: from the third, the host tier demotes its oldest
        first.on_block_evicted(d[i], i)
        first.build_connector_meta([None])
        steps.append(take(first))
    assert steps[1] == [stored([u[1]], "CPU")]
    assert steps[2] == [removed([u[0]], "CPU"), stored([u[0]]), stored([u[2]], "CPU")]
    # The disk tier full (d0, d1): demoting d2 evicts d0 first.
    assert steps[4] == [
        removed([u[2]], "CPU"),
        removed([u[0]]),
        stored([u[2]]),
        stored([u[4]], "CPU"),
    ]
    request = _request(list(range(13)))
    request.block_hashes[:] = [d[1]]
    assert first.get_num_new_matched_tokens(request, 0) == 4
    first.update_state_after_alloc(request, [7, 8, 9, 10], 0, 4)
    assert first.build_connector_meta([None]).disk_load_slots.size == 1
    assert take(first) == []  # a disk hit: d1 stays on the disk (the most recently used now)
    # Shutdown: host d3, d4 and device d5 wanted for two disk slots: d4, d5 evict d2, then d1.
    assert first.shutdown_plan([(d[5], 9)]) is not None
    assert take(first) == [
        removed([u[2]]),
        stored([u[4]]),
        removed([u[1]]),
        stored([u[5]]),
    ]
    first.shut_down()
    held = {"CPU": set(), "STORAGE": set()}  # a router following the next engine
    second = _persistent(tmp_path, num_host=2, num_disk=2, enable_kv_cache_events=True)
    assert take(second) == [stored([u[4], u[5]])]
    second.shut_down()
