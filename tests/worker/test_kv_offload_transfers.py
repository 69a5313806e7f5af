"""Host offload's worker half (issue 35): blocks copied to the host tier and back are the same bits, in
every layer and array, over several program calls; nothing compiles after warm-up."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.config import CacheConfig
from xlaserve.core.kv_connector import KVConnectorMetadata, KVConnectorWorker
from xlaserve.kernels import KVCache
from xlaserve.worker.compile_guard import CompileGuard
from xlaserve.worker.kv_offload import (
    TRANSFER_CHUNK_BLOCKS,
    BlockLayout,
    OffloadingConnectorWorker,
    available_host_bytes,
)
from xlaserve.worker.kv_transfer import make_kv_connector_worker

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM = 2, 40, 4, 2, 3


def _ids(values) -> np.ndarray:
    return np.asarray(values, np.int32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_blocks_round_trip_bit_for_bit_with_no_compile_after_warm_up(dtype):
    rng = np.random.default_rng(0)
    shape = (NUM_LAYERS * NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM)
    original = [rng.standard_normal(shape).astype(np.float32) for _ in range(2)]
    cache = KVCache(*(jnp.asarray(a, dtype) for a in original))
    expected = [np.asarray(a) for a in (cache.k, cache.v)]  # in `dtype`, on the host
    worker = OffloadingConnectorWorker(num_host_blocks=24, num_blocks=NUM_BLOCKS, layout=BlockLayout())
    cache = worker.warm_up(cache)
    guard = CompileGuard(strict=True)
    guard.arm()
    guard.begin()

    # More blocks than one program call moves: two calls each way.
    sources = list(range(1, TRANSFER_CHUNK_BLOCKS + 4))
    slots = list(range(len(sources)))[::-1]
    worker.save_kv(cache, KVConnectorMetadata(save_block_ids=_ids(sources), save_slots=_ids(slots)))
    worker.flush()
    targets = list(range(NUM_BLOCKS - len(sources), NUM_BLOCKS))
    cache = worker.load_kv(cache, KVConnectorMetadata(load_block_ids=_ids(targets), load_slots=_ids(slots)))
    guard.check("the transfers")  # raises on a compile

    for array, before in zip((cache.k, cache.v), expected):
        after = np.asarray(array)
        for layer in range(NUM_LAYERS):
            base = layer * NUM_BLOCKS
            src = [base + b for b in sources]
            dst = [base + b for b in targets]
            assert after[dst].tobytes() == before[src].tobytes()
            untouched = [base + b for b in range(1, NUM_BLOCKS) if b not in targets]
            assert after[untouched].tobytes() == before[untouched].tobytes()
    stats = worker.take_stats()
    assert stats.save_seconds > 0 and stats.load_seconds > 0
    assert worker.host_bytes == 24 * NUM_LAYERS * BLOCK_SIZE * HEADS * DIM * 2 * jnp.dtype(dtype).itemsize


def test_a_tier_larger_than_the_host_memory_is_refused_naming_the_field():
    available = available_host_bytes()
    if available is None:
        pytest.skip("no /proc/meminfo")
    too_big = CacheConfig(kv_offloading_size=2 * available / 2**30)
    with pytest.raises(ValueError, match=r"kv_offloading_size \(.* GiB\) is more than the host memory"):
        make_kv_connector_worker(too_big, bytes_per_block=4608, num_blocks=12)
    small = make_kv_connector_worker(
        CacheConfig(kv_offloading_size=2**-20), bytes_per_block=256, num_blocks=12
    )
    assert small.num_host_blocks == 4
    assert type(make_kv_connector_worker(CacheConfig(), 256, 12)) is KVConnectorWorker


@pytest.mark.parametrize(
    ("kv_heads", "copies", "dcp"), [(2, 1, 1), (2, 2, 1), (1, 2, 2), (2, 4, 2), (1, 4, 4)]
)
def test_a_block_leaves_the_cache_as_one_device_holds_it(kv_heads, copies, dcp):
    """`BlockLayout`: a cache whose heads are copied (tensor parallelism wider than the KV heads) and
    interleaved over groups of `dcp` copies (position p at slot p // dcp of copy p % dcp, as
    sharding/context_parallel.physical_slot_mapping places it) moves out each head once with its tokens
    in position order, and back into every copy: one device's block, whatever the layout."""
    from xlaserve.sharding.context_parallel import physical_slot_mapping

    block, dim, layers = 8, 3, 2
    layout = BlockLayout(kv_heads, dcp)
    rng = np.random.default_rng(3)
    one_device = rng.standard_normal((1, layers, block, kv_heads, dim)).astype(np.float32)  # [B, L, T, K, D]
    # The cache as the ranks write it: copy c of head h is cache head h * copies + c; it holds the
    # positions its rank in the group (c % dcp) owns, each at its physical slot.
    cache = np.zeros((1, layers, block // dcp, kv_heads * copies, dim), np.float32)
    for p in range(block):
        slot = physical_slot_mapping(np.asarray([p]), block, dcp)[0]
        for h in range(kv_heads):
            for c in range(copies):
                if c % dcp == p % dcp:
                    cache[:, :, slot, h * copies + c] = one_device[:, :, p, h]
    assert layout.moved_shape(cache.shape[2:]) == (block, kv_heads, dim)
    np.testing.assert_array_equal(np.asarray(layout.out_of_cache(jnp.asarray(cache))), one_device)
    np.testing.assert_array_equal(
        np.asarray(layout.into_cache(jnp.asarray(one_device), kv_heads * copies)), cache
    )
    with pytest.raises(ValueError, match="holds no"):
        BlockLayout(3, dcp).moved_shape(cache.shape[2:])


def test_a_drafters_cache_moves_beside_the_targets_in_its_own_shape_and_layout():
    """A tuple of caches with a layout each (the runner's and a draft's of another depth, heads and head
    size, its one head copied twice: worker/kv_plumbing.py `moved_kv_cache`): a block leaves and comes
    back in both, each array in its own shape, the draft's head moved once."""
    rng = np.random.default_rng(1)
    draft_layers, draft_dim = 1, 5

    def cache_of(layers, heads, dim):
        return KVCache(
            *(
                jnp.asarray(rng.standard_normal((layers * NUM_BLOCKS, BLOCK_SIZE, heads, dim)))
                for _ in range(2)
            )
        )

    draft_head = cache_of(draft_layers, 1, draft_dim)
    caches = (
        cache_of(NUM_LAYERS, HEADS, DIM),
        KVCache(*(jnp.repeat(a, 2, axis=2) for a in (draft_head.k, draft_head.v))),
    )
    before = [np.asarray(a) for c in caches for a in (c.k, c.v)]
    worker = OffloadingConnectorWorker(8, NUM_BLOCKS, (BlockLayout(), BlockLayout(kv_heads=1)))
    caches = worker.warm_up(caches)
    assert [s for s, _ in worker.chunk_shapes(caches)] == [
        *[(TRANSFER_CHUNK_BLOCKS, NUM_LAYERS, BLOCK_SIZE, HEADS, DIM)] * 2,
        *[(TRANSFER_CHUNK_BLOCKS, draft_layers, BLOCK_SIZE, 1, draft_dim)] * 2,
    ]
    sources, targets, slots = [3, 7], [30, 31], [5, 2]
    worker.save_kv(caches, KVConnectorMetadata(save_block_ids=_ids(sources), save_slots=_ids(slots)))
    worker.flush()
    caches = worker.load_kv(caches, KVConnectorMetadata(load_block_ids=_ids(targets), load_slots=_ids(slots)))
    after = [np.asarray(a) for c in caches for a in (c.k, c.v)]
    for i, (a, b) in enumerate(zip(after, before, strict=True)):
        layers = NUM_LAYERS if i < 2 else draft_layers
        for layer in range(layers):
            src, dst = [layer * NUM_BLOCKS + s for s in sources], [layer * NUM_BLOCKS + t for t in targets]
            assert a[dst].tobytes() == b[src].tobytes(), (i, layer)
    assert worker.host_bytes == 8 * BLOCK_SIZE * 2 * (NUM_LAYERS * HEADS * DIM + draft_layers * draft_dim) * 4
