"""Host offload and disaggregated prefill composed (core/kv_multi_connector.py), the scheduler's half: a
prompt's blocks come from the host tier first, from a producer's fetched blocks for the rest, each
loaded into the right device block; fetched blocks that no longer follow what the engine holds are
dropped (computed); stats count each prompt token queried once (host only, no jax)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from xlaserve.config import KVTransferConfig
from xlaserve.core.kv_cache_manager import KVCacheManager
from xlaserve.core.kv_multi_connector import MultiConnectorScheduler
from xlaserve.core.kv_offload import OffloadingConnectorScheduler
from xlaserve.core.kv_transfer import DisaggConnectorScheduler, RemoteKV
from xlaserve.core.request import Request
from xlaserve.sampling_params import SamplingParams

BLOCK_SIZE = 4


def _setup():
    offload = OffloadingConnectorScheduler(8, BLOCK_SIZE, bytes_per_block=100)
    disagg = DisaggConnectorScheduler(KVTransferConfig.parse({"kv_role": "kv_consumer"}), BLOCK_SIZE, 100)
    manager = KVCacheManager(BLOCK_SIZE, 32, True, 64)
    return offload, MultiConnectorScheduler([offload, disagg]), manager


def _request(name: str, num_host_blocks: int, offload, manager, first_fetched_block: int) -> Request:
    """A 33-token prompt (8 full blocks before its last token): its first `num_host_blocks` in the host
    tier, and a producer's blocks from `first_fetched_block` on attached, row i holding the value i."""
    request = Request(name, list(range(3, 36)), SamplingParams(max_tokens=2))
    assert manager.num_cached_tokens(request) == 0  # hashes its blocks; nothing on the device
    for block_hash in request.block_hashes[:num_host_blocks]:
        offload.index.allocate(block_hash)
    rows = np.repeat(np.arange(first_fetched_block, 8, dtype=np.uint8)[:, None], 100, axis=1)
    request.remote_kv = RemoteKV(32, (rows,), first_token=first_fetched_block * BLOCK_SIZE)
    return request


def _scheduled(request: Request, block_ids: list[int]):
    return [SimpleNamespace(request=request, num_computed_tokens=32, num_new_tokens=1, block_ids=block_ids)]


def test_the_host_tier_serves_first_and_the_fetch_the_rest():
    offload, multi, manager = _setup()
    request = _request("a", 3, offload, manager, first_fetched_block=3)
    assert multi.get_num_new_matched_tokens(request, 0) == 32  # 12 from the host, 20 fetched
    assert multi.get_num_new_matched_tokens(request, 4) == 28  # after a one-block device hit
    block_ids = list(range(10, 19))
    multi.update_state_after_alloc(request, block_ids, 0, 32)
    assert request.remote_kv is None  # loaded once
    meta = multi.build_connector_meta(_scheduled(request, block_ids))
    assert meta.load_block_ids.tolist() == [10, 11, 12]
    assert meta.inline_load_block_ids.tolist() == [13, 14, 15, 16, 17]
    assert meta.inline_blocks[0][:, 0].tolist() == [3, 4, 5, 6, 7]  # each fetched block in its place
    stats = multi.make_stats()
    assert (stats.num_queries, stats.num_hits, stats.num_remote_hits) == (33, 32, 20)
    assert stats.is_offloaded and stats.is_disaggregated


def test_fetched_blocks_after_a_gap_are_computed_instead():
    # The fetch skipped 3 blocks the host tier held, which has lost one of them since.
    offload, multi, manager = _setup()
    request = _request("b", 2, offload, manager, first_fetched_block=3)
    assert multi.get_num_new_matched_tokens(request, 0) == 8  # the host's two; nothing fetched follows
    block_ids = list(range(10, 19))
    multi.update_state_after_alloc(request, block_ids, 0, 8)
    assert request.remote_kv is None  # dropped: a recompute computes
    meta = multi.build_connector_meta(_scheduled(request, block_ids))
    assert meta.load_block_ids.tolist() == [10, 11] and not len(meta.inline_load_block_ids)
    stats = multi.make_stats()
    assert (stats.num_queries, stats.num_hits, stats.num_remote_hits) == (33, 8, 0)
