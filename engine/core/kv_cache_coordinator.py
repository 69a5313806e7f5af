"""Blocks per request and per group of layers, drawn from one pool (vLLM's KV cache coordinator).

`KVCacheManager` (core/kv_cache_manager.py) decides how many token slots a request needs; this
module turns that into blocks for each group of layers, by the group's kind (core/kv_cache_spec.py):
one manager per group, each holding its requests' block lists. A model with one full-attention group
(every model before state and windowed groups) has one `GroupBlocks`, whose lists are the
request's block table exactly as before.
"""

from __future__ import annotations

from collections.abc import Sequence

from xlaserve.core.block_pool import BlockPool, KVCacheBlock
from xlaserve.core.kv_cache_spec import CacheGroupSpec, KVCacheGroup
from xlaserve.core.limits import cdiv


class GroupBlocks:
    """One group's blocks per request, in token order (block i holds tokens [i*bs, (i+1)*bs)).

    A sliding-window group swaps blocks that fell out of the window for the null block (so table
    positions keep their meaning) and returns them to the pool. A state group holds one block, the
    request's state slot, and presents it once per block_size tokens in the block table.
    """

    def __init__(self, spec: CacheGroupSpec, pool: BlockPool, group_id: int):
        self.spec = spec
        self.pool = pool
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already in the prefix-cache index.
        self.num_cached_blocks: dict[str, int] = {}
        # Token slots each request was last allocated (a state group's table is as long as they need).
        self.num_slots: dict[str, int] = {}

    def num_new_blocks(self, request_id: str, num_slots: int, num_hit_blocks: int) -> int:
        """Blocks to take from the pool so the request holds `num_slots` slots."""
        num_held = len(self.req_to_blocks.get(request_id, ()))
        return max(self.spec.num_blocks(num_slots) - num_held - num_hit_blocks, 0)

    def remove_dead_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Return the blocks no later query of the request reads (a sliding window's) to the pool."""
        blocks = self.req_to_blocks.get(request_id)
        num_dead = self.spec.num_dead_blocks(num_computed_tokens)
        if not blocks or not num_dead:
            return
        dead = []
        for index in range(min(num_dead, len(blocks))):
            if not blocks[index].is_null:
                dead.append(blocks[index])
                blocks[index] = self.pool.null_block
        # Oldest last: a freed block keeps its hash, and the window's newest blocks are likelier hits.
        self.pool.free_blocks(reversed(dead))

    def allocate(
        self, request_id: str, num_slots: int, hit_blocks: Sequence[KVCacheBlock]
    ) -> list[KVCacheBlock]:
        """Reference the hits, then take the blocks still missing; returns the new ones."""
        num_new = self.num_new_blocks(request_id, num_slots, len(hit_blocks))
        blocks = self.req_to_blocks.setdefault(request_id, [])
        self.pool.touch(hit_blocks)
        blocks.extend(hit_blocks)
        new_blocks = self.pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        self.num_slots[request_id] = max(num_slots, self.num_slots.get(request_id, 0))
        return new_blocks

    def free(self, request_id: str, num_valid_tokens: int | None) -> None:
        """Release the request's blocks, tail first so a sequence's tail is evicted before its head.
        Blocks past `num_valid_tokens` (never written) leave the prefix-cache index."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_blocks.pop(request_id, None)
        self.num_slots.pop(request_id, None)
        if num_valid_tokens is not None:
            self.pool.uncache_blocks(blocks[num_valid_tokens // self.spec.block_size :])
        self.pool.free_blocks(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        """The block table the runner indexes by position // block_size."""
        blocks = self.req_to_blocks.get(request_id, [])
        if self.spec.holds_state and blocks:
            # One slot for every position: the runner's slot mapping stays in the slot's own range
            # (a state layer ignores it) and the table's first column is the slot.
            num_table_blocks = max(cdiv(self.num_slots.get(request_id, 0), self.spec.block_size), 1)
            return [blocks[0].block_id] * num_table_blocks
        return [block.block_id for block in blocks]


class KVCacheCoordinator:
    """Every group's blocks for every request; allocations are all-or-nothing across groups. A state
    group with `num_slots` draws from a pool of its own (a hybrid model's state slots)."""

    def __init__(self, groups: Sequence[KVCacheGroup], pool: BlockPool):
        if not groups:
            raise ValueError("kv_cache_groups must name at least one group")
        self.groups = tuple(groups)
        self.pool = pool
        self.managers = [
            GroupBlocks(group.spec, _group_pool(group.spec, pool), index)
            for index, group in enumerate(self.groups)
        ]

    @property
    def num_groups(self) -> int:
        return len(self.managers)

    def remove_dead_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for manager in self.managers:
            manager.remove_dead_blocks(request_id, num_computed_tokens)

    def num_blocks_to_allocate(
        self, request_id: str, num_slots: int, hits: Sequence[Sequence[KVCacheBlock]]
    ) -> int:
        """Free blocks the allocation consumes: new blocks in every group, plus hits on free blocks
        (a hit on a block with no owner takes it off the free queue)."""
        total = 0
        for manager, group_hits in zip(self.managers, hits):
            num_new = manager.num_new_blocks(request_id, num_slots, len(group_hits))
            if manager.pool is not self.pool:  # its own slots: none free means no allocation now
                if num_new > manager.pool.get_num_free_blocks():
                    return self.pool.num_blocks + 1
                continue
            total += num_new
            total += sum(1 for block in group_hits if block.ref_cnt == 0)
        return total

    def state_slot(self, request_id: str) -> int:
        """The request's state slot in the first group that keeps a state (0, the null slot, if none)."""
        for manager in self.managers:
            if manager.spec.holds_state:
                blocks = manager.req_to_blocks.get(request_id)
                return blocks[0].block_id if blocks else 0
        return 0

    def allocate(
        self, request_id: str, num_slots: int, hits: Sequence[Sequence[KVCacheBlock]]
    ) -> tuple[list[KVCacheBlock], ...]:
        return tuple(
            manager.allocate(request_id, num_slots, group_hits)
            for manager, group_hits in zip(self.managers, hits)
        )

    def free(self, request_id: str, num_valid_tokens: int | None = None) -> None:
        for manager in self.managers:
            manager.free(request_id, num_valid_tokens)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_num_hit_blocks: int
    ) -> tuple[list[KVCacheBlock], ...]:
        """Per group, the cached blocks of the longest prefix every group holds. A group's blocks
        are indexed under their own keys (`group_hashes`), so groups never hit each other's blocks."""
        hits = []
        num_hit = max_num_hit_blocks
        for manager in self.managers:
            keyed = group_hashes(block_hashes, manager.group_id)
            group_hits = []
            for index in range(num_hit):
                block = self.pool.get_cached_block(keyed[index])
                if block is None:
                    break
                group_hits.append(block)
            num_hit = len(group_hits)
            hits.append(group_hits)
        return tuple(group_hits[:num_hit] for group_hits in hits)

    def cache_blocks(
        self, request_id: str, block_hashes: Sequence[bytes], num_hit_blocks: int, num_full_blocks: int
    ):
        """Index each group's blocks of the request that are full once this step runs."""
        for manager in self.managers:
            blocks = manager.req_to_blocks[request_id]
            num_cached = max(manager.num_cached_blocks.get(request_id, 0), num_hit_blocks)
            self.pool.cache_full_blocks(
                blocks, group_hashes(block_hashes, manager.group_id), num_cached, num_full_blocks
            )
            manager.num_cached_blocks[request_id] = max(num_cached, num_full_blocks)


def _group_pool(spec: CacheGroupSpec, shared: BlockPool) -> BlockPool:
    """The pool a group draws from: its own when its spec sizes one (a hybrid model's state slots)."""
    num_slots = getattr(spec, "num_slots", None)
    return shared if num_slots is None else BlockPool(num_slots, enable_caching=False)


class _KeyedHashes(Sequence):
    """A request's block hashes, each suffixed by a group id (computed on access, never stored)."""

    def __init__(self, block_hashes: Sequence[bytes], key: bytes):
        self._hashes = block_hashes
        self._key = key

    def __len__(self) -> int:
        return len(self._hashes)

    def __getitem__(self, index):
        return self._hashes[index] + self._key


def group_hashes(block_hashes: Sequence[bytes], group_id: int) -> Sequence[bytes]:
    """The keys a group's blocks are cached under: group 0's are the plain chained hashes (so a
    one-group model, and the KV connector that indexes them, see what they always saw)."""
    if group_id == 0:
        return block_hashes
    return _KeyedHashes(block_hashes, b"group" + group_id.to_bytes(2, "little"))
