"""KVCacheManager: prefix hits, allocation, eviction order, ref counts (host only, no jax)."""

import itertools

import msgspec
import numpy as np
import pytest

import xlaserve.core.kv_cache_manager as kv_cache_manager_module
from helpers import vllm_kv_events as vllm
from xlaserve.core import kv_events
from xlaserve.core.kv_cache_manager import KVCacheManager
from xlaserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from xlaserve.core.multimodal import MultiModalFeature
from xlaserve.core.request import Request
from xlaserve.lora_request import LoRARequest
from xlaserve.sampling_params import SamplingParams

BLOCK_SIZE = 4
_request_ids = itertools.count()


def assert_no_leaked_blocks(manager: KVCacheManager) -> None:
    """No request holds a block; all but the null block are free and unreferenced."""
    pool = manager.block_pool
    assert not manager.req_to_blocks and not manager.num_cached_blocks
    assert sorted(b.block_id for b in pool.free_block_queue.get_all_free_blocks()) == list(
        range(1, pool.num_blocks)
    )
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert manager.usage == 0.0


@pytest.fixture
def make_manager():
    """Builds managers and checks, after the test, that every block came back."""
    managers = []

    def factory(num_blocks=16, enable_caching=True, max_model_len=64, block_size=BLOCK_SIZE, **kwargs):
        manager = KVCacheManager(block_size, num_blocks, enable_caching, max_model_len, **kwargs)
        managers.append(manager)
        return manager

    yield factory
    for manager in managers:
        assert_no_leaked_blocks(manager)


def make_request(prompt, *, cache_salt=None, **params) -> Request:
    params.setdefault("max_tokens", 8)
    return Request(f"r{next(_request_ids)}", list(prompt), SamplingParams(**params), cache_salt=cache_salt)


def admit(manager: KVCacheManager, request: Request, num_new_tokens: int | None = None) -> int:
    """What the scheduler does for a waiting request: look up hits, allocate, advance."""
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - num_hit_tokens
    assert manager.allocate_slots(request, num_new_tokens, hit_blocks) is not None
    request.num_computed_tokens = num_hit_tokens + num_new_tokens
    return num_hit_tokens


def test_miss_then_hit_in_whole_blocks(make_manager):
    manager = make_manager()
    first = make_request(range(10))
    assert admit(manager, first) == 0
    assert manager.get_block_ids(first.request_id) == [1, 2, 3]
    second = make_request(list(range(10)) + [99])
    # Blocks [0:4] and [4:8] are full and cached; tokens 8, 9 sit in a partial block.
    assert admit(manager, second) == 8
    assert manager.get_block_ids(second.request_id)[:2] == [1, 2]
    assert second.num_computed_tokens == 11
    manager.free(first)
    manager.free(second)


def test_hit_never_covers_the_whole_request(make_manager):
    manager = make_manager()
    first = make_request(range(8))
    admit(manager, first)
    same = make_request(range(8))
    # 8 tokens are cached, but the last token must run to produce logits: 7 -> one block.
    blocks, num_hit_tokens = manager.get_computed_blocks(same)
    assert num_hit_tokens == 4 and len(blocks) == 1
    longer = make_request(range(9))
    assert manager.get_computed_blocks(longer)[1] == 8
    manager.free(first)


def test_prefix_cache_stats_count_tokens_and_reset(make_manager):
    manager = make_manager()
    first = make_request(range(10))
    admit(manager, first)
    second = make_request(range(10))
    admit(manager, second)
    stats = manager.prefix_cache_stats
    assert (stats.num_requests, stats.num_queries, stats.num_hits) == (2, 20, 8)
    assert stats.hit_rate == pytest.approx(0.4)
    snapshot = manager.make_prefix_cache_stats()
    assert snapshot.num_hits == 8 and manager.prefix_cache_stats.num_queries == 0
    snapshot.reset()
    assert (snapshot.num_requests, snapshot.num_queries, snapshot.num_hits) == (0, 0, 0)
    assert snapshot.hit_rate == 0.0
    manager.free(first)
    manager.free(second)


def test_salted_requests_never_share_blocks(make_manager):
    manager = make_manager()
    plain = make_request(range(12))
    admit(manager, plain)
    salted = make_request(range(12), cache_salt="tenant-a")
    assert admit(manager, salted) == 0
    assert not set(manager.get_block_ids(plain.request_id)) & set(manager.get_block_ids(salted.request_id))
    # Every block hash differs, not only the first one.
    assert all(a != b for a, b in zip(plain.block_hashes, salted.block_hashes, strict=True))
    same_salt = make_request(range(12), cache_salt="tenant-a")
    other_salt = make_request(range(12), cache_salt="tenant-b")
    assert manager.get_computed_blocks(same_salt)[1] == 8
    assert manager.get_computed_blocks(other_salt)[1] == 0
    manager.free(plain)
    manager.free(salted)
    unsalted_again = make_request(range(12))
    assert manager.get_computed_blocks(unsalted_again)[1] == 8


def test_shared_prefix_ref_counts(make_manager):
    manager = make_manager()
    first = make_request(range(9))
    admit(manager, first)
    second = make_request(list(range(8)) + [50, 51])
    admit(manager, second)
    shared = manager.get_blocks(first.request_id)[:2]
    assert manager.get_blocks(second.request_id)[:2] == shared
    assert [block.ref_cnt for block in shared] == [2, 2]
    manager.free(first)
    assert [block.ref_cnt for block in shared] == [1, 1]
    assert not set(shared) & set(manager.block_pool.free_block_queue.get_all_free_blocks())
    manager.free(second)
    assert [block.ref_cnt for block in shared] == [0, 0]


def test_freed_blocks_stay_hittable_and_lru_evicts_tail_first(make_manager):
    manager = make_manager(num_blocks=7)  # 6 usable
    old = make_request(range(12))  # blocks 1, 2, 3
    admit(manager, old)
    manager.free(old)
    # Tail first: the sequence's last block is evicted before its head.
    free_order = manager.block_pool.free_block_queue.get_all_free_blocks()
    assert [block.block_id for block in free_order] == [4, 5, 6, 3, 2, 1]
    assert manager.get_computed_blocks(make_request(range(13)))[1] == 12
    # Allocating 4 blocks uses the never-used ones, then evicts the tail block 3.
    other = make_request(range(100, 116))
    admit(manager, other)
    assert manager.get_block_ids(other.request_id) == [4, 5, 6, 3]
    assert manager.get_computed_blocks(make_request(range(13)))[1] == 8
    manager.free(other)


def test_least_recently_freed_request_is_evicted_first(make_manager):
    manager = make_manager(num_blocks=5)  # 4 usable
    first, second = make_request(range(8)), make_request(range(100, 108))
    admit(manager, first)
    admit(manager, second)
    manager.free(first)
    manager.free(second)
    newcomer = make_request(range(200, 208))
    admit(manager, newcomer)
    # first was freed earlier, so its blocks were evicted; second's survive.
    assert manager.get_computed_blocks(make_request(range(9)))[1] == 0
    assert manager.get_computed_blocks(make_request(range(100, 109)))[1] == 8
    manager.free(newcomer)


def test_allocate_fails_atomically_when_short(make_manager):
    manager = make_manager(num_blocks=4)  # 3 usable
    hog = make_request(range(8))
    admit(manager, hog)
    too_big = make_request(range(100, 109))
    assert manager.allocate_slots(too_big, 9) is None
    assert manager.num_free_blocks == 1 and too_big.request_id not in manager.req_to_blocks
    fits = make_request(range(100, 104))
    assert manager.allocate_slots(fits, 4) is not None
    manager.free(hog)
    manager.free(fits)


def test_hits_on_free_blocks_count_against_free_space(make_manager):
    manager = make_manager(num_blocks=4)  # 3 usable
    cached = make_request(range(8))
    admit(manager, cached)
    manager.free(cached)
    # Two hit blocks leave the free queue, so only one block is left for new tokens.
    request = make_request(range(13))
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
    assert num_hit_tokens == 8
    assert manager.allocate_slots(request, 5, hit_blocks) is None
    assert manager.num_free_blocks == 3 and all(block.ref_cnt == 0 for block in hit_blocks)
    assert manager.allocate_slots(request, 4, hit_blocks) is not None
    assert manager.num_free_blocks == 0
    manager.free(request)


def test_allocation_grows_incrementally_across_chunks_and_decodes(make_manager):
    manager = make_manager()
    request = make_request(range(10))
    assert len(manager.allocate_slots(request, 6)) == 2
    request.num_computed_tokens = 6
    assert len(manager.allocate_slots(request, 2)) == 0  # tokens 6, 7 fit in block 2
    request.num_computed_tokens = 8
    assert len(manager.allocate_slots(request, 2)) == 1
    request.num_computed_tokens = 10
    request.append_output_token_ids(42)
    assert manager.allocate_slots(request, 1) == []
    assert manager.get_block_ids(request.request_id) == [1, 2, 3]
    manager.free(request)


def test_blocks_full_by_end_of_step_are_hittable_in_the_same_step(make_manager):
    manager = make_manager()
    running = make_request(range(10))
    manager.allocate_slots(running, 6)  # chunk [0:6]: block 0 full by the end of this step
    assert len(running.block_hashes) == 2  # hashes exist for the full blocks of the prompt
    assert manager.get_computed_blocks(make_request(range(11)))[1] == 4
    running.num_computed_tokens = 6
    manager.allocate_slots(running, 4)
    assert manager.get_computed_blocks(make_request(range(11)))[1] == 8
    manager.free(running)


def test_block_hashes_are_computed_once_per_block(make_manager, monkeypatch):
    calls = []
    real_hash = kv_cache_manager_module.hash_block_tokens
    monkeypatch.setattr(
        kv_cache_manager_module, "hash_block_tokens", lambda *args: calls.append(args) or real_hash(*args)
    )
    manager = make_manager()
    request = make_request(range(6), max_tokens=10)
    admit(manager, request)
    assert len(calls) == 1 and len(request.block_hashes) == 1
    for token_id in range(100, 106):
        request.append_output_token_ids(token_id)
        manager.allocate_slots(request, 1)
        request.num_computed_tokens += 1
    assert len(request.block_hashes) == 3 and len(calls) == 3
    manager.free(request)


def test_free_with_valid_tokens_uncaches_unwritten_blocks(make_manager):
    manager = make_manager()
    request = make_request(range(12))
    admit(manager, request, num_new_tokens=4)  # an earlier step wrote block 0
    manager.allocate_slots(request, 8)  # blocks 1 and 2 indexed, but this step never runs
    assert manager.get_computed_blocks(make_request(range(13)))[1] == 12
    manager.free(request, num_valid_tokens=4)
    assert manager.get_computed_blocks(make_request(range(13)))[1] == 4
    request2 = make_request(range(12))
    admit(manager, request2)
    manager.free(request2, num_valid_tokens=8)
    assert manager.get_computed_blocks(make_request(range(13)))[1] == 8


def test_prompt_logprobs_and_disabled_caching_skip_the_cache(make_manager):
    manager = make_manager()
    first = make_request(range(12))
    admit(manager, first)
    assert manager.get_computed_blocks(make_request(range(12), prompt_logprobs=1)) == ([], 0)
    manager.free(first)

    uncached = make_manager(enable_caching=False)
    request = make_request(range(12))
    admit(uncached, request)
    assert request.block_hashes == [] and not uncached.block_pool.cached_block_hash_to_block
    assert uncached.get_computed_blocks(make_request(range(12))) == ([], 0)
    uncached.free(request)


def test_reset_prefix_cache(make_manager):
    manager = make_manager()
    request = make_request(range(12))
    admit(manager, request)
    manager.free(request)
    assert manager.reset_prefix_cache()
    assert manager.prefix_cache_stats.is_reset
    assert manager.get_computed_blocks(make_request(range(12)))[1] == 0


def _stored(request, first: int, last: int, parent: int | None) -> BlockStored:
    """The BlockStored of blocks first..last of `request`: its hashes as u64 (a digest's last 8 bytes)."""
    return BlockStored(
        block_hashes=[int.from_bytes(h[-8:], "big") for h in request.block_hashes[first : last + 1]],
        parent_block_hash=parent,
        token_ids=request.all_token_ids[first * BLOCK_SIZE : (last + 1) * BLOCK_SIZE],
        block_size=BLOCK_SIZE,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[None] * (last + 1 - first),  # vLLM's: one entry per block, None for a plain one
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )


def test_kv_events_follow_the_prefix_cache(make_manager):
    manager = make_manager(num_blocks=7, enable_kv_cache_events=True)  # 6 usable
    first = make_request(range(10))  # blocks 1, 2 full (cached), 3 partial
    admit(manager, first)
    assert manager.take_events() == [_stored(first, 0, 1, parent=None)]
    second = make_request([*range(8), 50, 51, 52, 53, 54])  # hits 1, 2; stores one block (4), 5 partial
    admit(manager, second)
    u64 = [int.from_bytes(h[-8:], "big") for h in second.block_hashes]
    assert manager.take_events() == [_stored(second, 2, 2, parent=u64[1])]  # hits are not stored again
    manager.free(first)
    manager.free(second)
    assert manager.take_events() == []  # freed blocks stay cached
    # 4 blocks from the free queue [6, 3, 5, 4, 2, 1]: 6, 3 and 5 hold no full block; 4 is evicted.
    other = make_request(range(100, 116))
    admit(manager, other)
    assert manager.get_block_ids(other.request_id) == [6, 3, 5, 4]
    assert manager.take_events() == [
        BlockRemoved(block_hashes=[u64[2]], medium="GPU", group_idx=0),
        _stored(other, 0, 3, parent=None),
    ]
    manager.free(other)
    assert manager.reset_prefix_cache()
    assert manager.take_events() == [AllBlocksCleared()]
    # Off (the default): the pool holds no recorder, so nothing is kept for anyone.
    off = make_manager()
    admit(off, request := make_request(range(10)))
    assert off.block_pool.kv_events is None and off.take_events() == []
    off.free(request)


def test_kv_events_carry_extra_keys_and_a_reset_while_running_stores_the_chain_again(make_manager):
    manager = make_manager(enable_kv_cache_events=True)
    image = MultiModalFeature("image", "img", offset=6, length=4, data=np.zeros(1, np.float32))

    def tenant_request(request_id):
        return Request(
            request_id,
            list(range(13)),
            SamplingParams(max_tokens=8),
            cache_salt="salt",
            lora_request=LoRARequest("adapter", 1, "/adapters/a"),
            mm_features=[image],
        )

    request = tenant_request("first")
    admit(manager, request)  # blocks 0..2 full: the image's tokens 6..9 lie in blocks 1 and 2
    (stored,) = manager.take_events()
    # vLLM's order, typed as vLLM main publishes them: the adapter's name on every block, the image (its
    # hash, its placeholders' start relative to the block's), the salt on the first.
    lora = kv_events.LoRAKey("adapter")
    assert stored.extra_keys == [
        (lora, kv_events.CacheSaltKey("salt")),
        (lora, kv_events.MultiModalKey("image", "img", 2)),
        (lora, kv_events.MultiModalKey("image", "img", -2)),
    ]
    # On the wire: vLLM main's typed decoder reads them; a 0.26 subscriber (`extra_keys` of Any) still
    # decodes the batch, each key a map tagged by its type.
    wire = msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=[stored]))
    (theirs,) = vllm.DECODER.decode(wire).events
    assert theirs.extra_keys[1] == (vllm.LoRAKey("adapter"), vllm.MultiModalKey("image", "img", 2))
    assert theirs.event_version == 1
    (raw,) = msgspec.msgpack.decode(wire)[1]
    assert raw["extra_keys"][0] == [
        {"type": "lora", "name": "adapter"},
        {"type": "cache_salt", "salt": "salt"},
    ]
    assert (stored.lora_id, stored.lora_name) == (1, "adapter")
    # A reset while the request holds its blocks: a router drops them all, and so does the index; at
    # its next step the request indexes them again from the first, so the chain a router hears after
    # AllBlocksCleared starts at a root (no block whose parent it was told to forget).
    assert manager.reset_prefix_cache() and manager.take_events() == [AllBlocksCleared()]
    request.append_output_token_ids([100, 101, 102])
    assert manager.allocate_slots(request, 3) is not None
    request.num_computed_tokens = 16
    (again,) = manager.take_events()
    u64 = [int.from_bytes(h[-8:], "big") for h in request.block_hashes]
    assert (again.block_hashes, again.parent_block_hash, len(again.token_ids)) == (u64, None, 16)
    assert manager.get_computed_blocks(tenant_request("next"))[1] == 12  # what the router was told
    manager.free(request)


def test_sizes_usage_and_max_model_len(make_manager):
    manager = make_manager(num_blocks=9, max_model_len=16)
    assert [manager.blocks_needed(n) for n in (1, 4, 5, 16)] == [1, 1, 2, 4]
    assert manager.num_usable_blocks == 8 and manager.num_free_blocks == 8
    request = make_request(range(8), max_tokens=8)
    manager.allocate_slots(request, 8)
    assert manager.usage == pytest.approx(2 / 8)
    request.num_computed_tokens = 8
    with pytest.raises(ValueError, match="max_model_len"):
        manager.allocate_slots(request, 9)
    manager.free(request)
    assert manager.get_block_ids("unknown") == []
