"""BlockPool, its O(1) free queue and block hashing (host only, no jax)."""

import pytest

from xlaserve.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock, hash_block_tokens


def assert_no_leaked_blocks(pool: BlockPool) -> None:
    """Every block but the null block is free, unreferenced and in the free queue exactly once."""
    free_ids = [block.block_id for block in pool.free_block_queue.get_all_free_blocks()]
    assert sorted(free_ids) == list(range(1, pool.num_blocks))
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert pool.get_usage() == 0.0
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash


@pytest.fixture
def make_pool():
    """Builds pools and checks, after the test, that each got all its blocks back."""
    pools = []

    def factory(num_blocks: int = 8, enable_caching: bool = True) -> BlockPool:
        pool = BlockPool(num_blocks, enable_caching)
        pools.append(pool)
        return pool

    yield factory
    for pool in pools:
        assert_no_leaked_blocks(pool)


def ids(blocks):
    return [block.block_id for block in blocks]


# -- hashing -----------------------------------------------------------------------------------


def test_hash_is_deterministic_sha256_bytes():
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(first, bytes) and len(first) == 32
    assert first == hash_block_tokens(None, (1, 2, 3, 4))


def test_hash_depends_on_tokens_order_parent_and_extra_keys():
    base = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(None, [4, 3, 2, 1]) != base
    assert hash_block_tokens(base, [1, 2, 3, 4]) != base
    assert hash_block_tokens(None, [1, 2, 3, 4], ("salt",)) != base
    assert hash_block_tokens(None, [1, 2, 3, 4], ("salt",)) != hash_block_tokens(
        None, [1, 2, 3, 4], ("pepper",)
    )
    # Same tokens under different prefixes must never collide: that is what chaining is for.
    parent_a, parent_b = hash_block_tokens(None, [9, 9]), hash_block_tokens(None, [8, 8])
    assert hash_block_tokens(parent_a, [5, 6]) != hash_block_tokens(parent_b, [5, 6])


def test_hash_of_large_token_ids():
    assert hash_block_tokens(None, [2**40]) != hash_block_tokens(None, [0])


# -- free queue ---------------------------------------------------------------------------------


def test_free_queue_popleft_append_and_remove_from_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert len(queue) == 5
    queue.remove(blocks[2])
    assert ids(queue.get_all_free_blocks()) == [0, 1, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    queue.remove(blocks[4])
    assert ids(queue.get_all_free_blocks()) == [1, 3, 2]
    assert len(queue) == 3
    assert [queue.popleft().block_id for _ in range(3)] == [1, 3, 2]
    with pytest.raises(ValueError, match="no free"):
        queue.popleft()


def test_free_queue_remove_of_absent_block_raises():
    block = KVCacheBlock(7)
    queue = FreeKVCacheBlockQueue([])
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(block)


def test_block_repr_does_not_walk_links():
    blocks = [KVCacheBlock(i) for i in range(3)]
    FreeKVCacheBlockQueue(blocks)
    assert repr(blocks[1]) == "KVCacheBlock(1, ref_cnt=0)"


# -- pool -----------------------------------------------------------------------------------


def test_null_block_is_never_handed_out(make_pool):
    pool = make_pool(num_blocks=6)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    blocks = pool.get_new_blocks(5)
    assert 0 not in ids(blocks)
    assert pool.get_num_free_blocks() == 0 and pool.get_usage() == 1.0
    with pytest.raises(ValueError, match="only 0 are free"):
        pool.get_new_blocks(1)
    # Freeing or touching the null block is a no-op: it is never in the free queue.
    pool.free_blocks([pool.null_block])
    pool.touch([pool.null_block])
    assert pool.get_num_free_blocks() == 0
    pool.free_blocks(blocks)


def test_pool_needs_a_usable_block():
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        BlockPool(1)


def test_new_blocks_come_in_lru_order_with_ref_one(make_pool):
    pool = make_pool(num_blocks=6)
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [1, 2, 3]
    assert all(block.ref_cnt == 1 for block in blocks)
    assert pool.get_usage() == pytest.approx(3 / 5)
    pool.free_blocks([blocks[2], blocks[0], blocks[1]])
    # Blocks 4 and 5 were never used, then 3, 1, 2 in the order they were freed.
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [4, 5, 3, 1, 2]


def test_touch_takes_free_block_out_of_queue_and_counts_refs(make_pool):
    pool = make_pool(num_blocks=4)
    [block] = pool.get_new_blocks(1)
    pool.free_blocks([block])
    assert block in pool.free_block_queue.get_all_free_blocks()
    pool.touch([block])
    pool.touch([block])
    assert block.ref_cnt == 2
    assert block not in pool.free_block_queue.get_all_free_blocks()
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    pool.free_blocks([block])
    assert pool.free_block_queue.get_all_free_blocks()[-1] is block


def test_double_free_raises(make_pool):
    pool = make_pool()
    [block] = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([block])


def test_cached_block_stays_hittable_until_reused(make_pool):
    pool = make_pool(num_blocks=3)
    blocks = pool.get_new_blocks(2)
    hashes = [hash_block_tokens(None, [1]), hash_block_tokens(None, [2])]
    pool.cache_full_blocks(blocks, hashes, num_cached_blocks=0, num_full_blocks=2)
    pool.free_blocks(blocks)
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert pool.get_cached_block(hashes[1]) is blocks[1]
    # Reusing the least recently freed block evicts its hash, and only its hash.
    [reused] = pool.get_new_blocks(1)
    assert reused is blocks[0] and reused.block_hash is None
    assert pool.get_cached_block(hashes[0]) is None
    assert pool.get_cached_block(hashes[1]) is blocks[1]
    pool.free_blocks([reused])


def test_cache_full_blocks_only_indexes_the_new_range(make_pool):
    pool = make_pool(num_blocks=5)
    blocks = pool.get_new_blocks(4)
    hashes = [hash_block_tokens(None, [i]) for i in range(4)]
    pool.cache_full_blocks(blocks, hashes, num_cached_blocks=1, num_full_blocks=3)
    assert [block.block_hash for block in blocks] == [None, hashes[1], hashes[2], None]
    assert pool.get_cached_block(hashes[0]) is None
    pool.free_blocks(blocks)


def test_duplicate_hash_keeps_first_block(make_pool):
    pool = make_pool(num_blocks=4)
    first, second = pool.get_new_blocks(2)
    block_hash = hash_block_tokens(None, [1, 2])
    pool.cache_full_blocks([first], [block_hash], 0, 1)
    pool.cache_full_blocks([second], [block_hash], 0, 1)
    assert pool.get_cached_block(block_hash) is first
    assert second.block_hash is None
    # Dropping the uncached duplicate must not drop the cached entry.
    pool.uncache_blocks([second])
    assert pool.get_cached_block(block_hash) is first
    pool.free_blocks([first, second])


def test_caching_disabled_indexes_nothing(make_pool):
    pool = make_pool(enable_caching=False)
    blocks = pool.get_new_blocks(1)
    block_hash = hash_block_tokens(None, [3])
    pool.cache_full_blocks(blocks, [block_hash], 0, 1)
    assert pool.get_cached_block(block_hash) is None
    pool.free_blocks(blocks)


def test_uncache_and_reset_prefix_cache(make_pool):
    pool = make_pool(num_blocks=4)
    blocks = pool.get_new_blocks(2)
    hashes = [hash_block_tokens(None, [i]) for i in range(2)]
    pool.cache_full_blocks(blocks, hashes, 0, 2)
    pool.uncache_blocks(blocks[1:])
    assert pool.get_cached_block(hashes[1]) is None and blocks[1].block_hash is None
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(hashes[0]) is None
    assert all(block.block_hash is None for block in pool.blocks)
