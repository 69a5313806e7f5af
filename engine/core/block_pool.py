"""The pool of KV cache blocks: ref counts, an O(1) LRU free queue and the prefix-cache index."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from xlaserve.core.kv_events import KVEventRecorder

# Parent "hash" of a request's first block: a fixed root so chains are comparable across requests.
_ROOT_HASH = b"\x00" * 32


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple | None = None
) -> bytes:
    """SHA-256 digest of one full block, chained to its parent block's digest.

    Chaining makes a block's hash identify the whole prefix up to and including it, so equal
    hashes mean equal K/V. `extra_keys` (e.g. a cache salt, only on the first block) separate
    otherwise identical prefixes: through the chain, a salt changes every later block's hash too.
    """
    hasher = hashlib.sha256(_ROOT_HASH if parent_hash is None else parent_hash)
    token_bytes = np.asarray(token_ids, dtype="<i8").tobytes()
    hasher.update(len(token_bytes).to_bytes(8, "little"))
    hasher.update(token_bytes)
    if extra_keys is not None:
        hasher.update(repr(tuple(extra_keys)).encode())
    return hasher.digest()


def _ignore_eviction(block_hash: bytes, block_id: int) -> None:
    pass


class KVCacheBlock:
    """One block of `block_size` token slots in every layer's KV cache."""

    __slots__ = ("block_hash", "block_id", "is_null", "next_free_block", "prev_free_block", "ref_cnt")

    def __init__(self, block_id: int, *, is_null: bool = False):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None  # set while the block is in the prefix-cache index
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = is_null

    def __repr__(self) -> str:
        # The free-queue links are left out: printing them would walk the whole list.
        cached = "" if self.block_hash is None else f", hash={self.block_hash[:4].hex()}"
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order (least recently freed first), as a doubly linked list.

    A deque would not do: a prefix-cache hit may land on a block that is free (ref 0) but still
    holds its K/V and hash, and that block must leave the free queue wherever it sits. Linking
    the blocks through their own prev/next fields makes that removal O(1), like popleft and append.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]):
        # Sentinels at both ends remove every empty-list and end-of-list branch.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        """Remove and return the least recently freed block."""
        block = self._head.next_free_block
        if block is self._tail:
            raise ValueError("no free KV cache blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block`, wherever it sits in the queue."""
        if block.prev_free_block is None or block.next_free_block is None:
            raise ValueError(f"{block} is not in the free queue")
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the tail: it will be evicted last."""
        self._link(block, self._tail.prev_free_block, self._tail)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put `block` at the head: it is taken first (it holds nothing worth keeping)."""
        self._link(block, self._head, self._head.next_free_block)

    def _link(self, block: KVCacheBlock, before: KVCacheBlock, after: KVCacheBlock) -> None:
        before.next_free_block = block
        block.prev_free_block = before
        block.next_free_block = after
        after.prev_free_block = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks in eviction order (for tests and debugging)."""
        blocks = []
        block = self._head.next_free_block
        while block is not self._tail:
            blocks.append(block)
            block = block.next_free_block
        return blocks


class BlockPool:
    """Owns every KV cache block: hands them out, takes them back, indexes full ones by hash.

    Block 0 is the null block: never allocated and never freed; padding tokens write there,
    so a padded batch can never corrupt a live block. A freed block keeps its hash until it is
    reused, so a later request with the same prefix can still hit it.

    `on_evict(block_hash, block_id)`: called when a cached block is taken for reuse, before anything
    overwrites it (a KV connector copies it to the host tier: core/kv_offload.py).

    `kv_events`: records each block entering and leaving the index, and each reset, for the engine
    core to publish (core/kv_events.py); None (events off) records nothing and keeps no list.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        on_evict: Callable[[bytes, int], None] | None = None,
        kv_events: KVEventRecorder | None = None,
    ):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i, is_null=(i == 0)) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        self.on_evict = on_evict or _ignore_eviction
        self.kv_events = kv_events

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that requests can ever hold: all but the null block."""
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        """Blocks with no owner (cached ones included: they are evictable)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks held by requests, in [0, 1]."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` least recently freed blocks, evicting their cached hashes; ref 1 each."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(
                f"cannot allocate {num_blocks} blocks: only {self.get_num_free_blocks()} are free"
            )
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            assert block.ref_cnt == 0, f"{block} was in the free queue while referenced"
            if block.block_hash is not None:
                self.on_evict(block.block_hash, block.block_id)
            self._uncache_block(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each block (prefix-cache hits); a free one leaves the free queue."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock], *, reuse_first: bool = False) -> None:
        """Drop a reference from each block; ones reaching 0 join the free queue in the given order.

        Pass blocks in the order they should be evicted (a request's tail first). `reuse_first`: they
        join at the head instead, taken before any cached block is evicted (a state group's live slot,
        whose contents no later request can hit).
        """
        for block in ordered_blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if reuse_first:
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[bytes],
        num_cached_blocks: int,
        num_full_blocks: int,
        request=None,
    ) -> None:
        """Index blocks[num_cached_blocks:num_full_blocks] of one request under their hashes.

        A block already indexed (it was a prefix-cache hit) keeps its entry. When another block
        already holds the same hash (two requests computed the same prefix), the first stays
        the cached copy and this one simply is not indexed. `request` (whose tokens the blocks hold):
        with events on, the blocks indexed here are recorded as stored.
        """
        if not self.enable_caching:
            return
        stored = [] if self.kv_events is not None and request is not None else None
        for index in range(num_cached_blocks, num_full_blocks):
            block = blocks[index]
            if block.block_hash is not None or block.is_null:
                continue
            block_hash = block_hashes[index]
            if block_hash in self.cached_block_hash_to_block:
                continue
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block
            if stored is not None:
                stored.append(index)
        if stored:
            self.kv_events.record_stored(block_hashes, stored, request)

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        """The block holding the prefix with this hash, or None."""
        return self.cached_block_hash_to_block.get(block_hash)

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop blocks from the prefix-cache index (their K/V will never be written)."""
        for block in blocks:
            self._uncache_block(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; blocks in use keep their K/V, unindexed until their request
        caches them again (KVCacheManager.reset_prefix_cache)."""
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        if self.kv_events is not None:
            self.kv_events.record_cleared()
        return True

    def _uncache_block(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
            if self.kv_events is not None:
                self.kv_events.record_removed(block.block_hash)
        block.block_hash = None
