"""Blocks per request and per group of layers, drawn from one pool (vLLM's KV cache coordinator).

`KVCacheManager` (core/kv_cache_manager.py) decides how many token slots a request needs; this
module turns that into blocks for each group of layers, by the group's kind (core/kv_cache_spec.py):
one manager per group, each holding its requests' block lists. A model with one full-attention group
(every model before state and windowed groups) has one `GroupBlocks`, whose lists are the
request's block table exactly as before.

A state group (`StateGroupBlocks`) serves prefix hits through snapshots: a step whose chunk ends on a
block boundary of the prompt copies the request's live slot into a snapshot slot after its forward,
indexed under that block's hash once the step's output is applied; a later request whose prefix ends
there gets a live slot of its own and the snapshot copied into it before its first forward (the
`StateCopy` the step carries to the runner). A hit is then the longest prefix every group holds that
ends where a snapshot was taken.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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

    def num_pool_blocks(self, request_id: str, num_slots: int, hits: Sequence[KVCacheBlock]) -> int:
        """Free blocks of its pool the allocation consumes: the new ones, and hits on free blocks (a
        hit on a block with no owner takes it off the free queue)."""
        num_new = self.num_new_blocks(request_id, num_slots, len(hits))
        return num_new + sum(1 for block in hits if block.ref_cnt == 0 and not block.is_null)

    def longest_hit(self, block_hashes: Sequence[bytes], max_num_blocks: int) -> list[KVCacheBlock]:
        """The blocks of the longest prefix of at most `max_num_blocks` blocks this group serves from
        the prefix cache: every block a query after the prefix reads must be cached, so all of them
        under full attention, a window's under a sliding window (vLLM's), whose earlier blocks are
        the null block in the hit as they are in a running request's table."""
        keyed = group_hashes(block_hashes, self.group_id)
        block_size = self.spec.block_size
        if not self.spec.num_dead_blocks(max_num_blocks * block_size):  # every block is read
            hits = []
            for position in range(max_num_blocks):
                block = self.pool.get_cached_block(keyed[position])
                if block is None:
                    break
                hits.append(block)
            return hits
        cached = [self.pool.get_cached_block(keyed[position]) for position in range(max_num_blocks)]
        run_ends = []  # cached blocks in a row ending at each position
        for block in cached:
            run_ends.append(run_ends[-1] + 1 if run_ends and block is not None else int(block is not None))
        for num_blocks in range(max_num_blocks, 0, -1):
            first_read = self.spec.num_dead_blocks(num_blocks * block_size)
            if run_ends[num_blocks - 1] >= num_blocks - first_read:
                return [self.pool.null_block] * first_read + cached[first_read:num_blocks]
        return []

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
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def cache_blocks(
        self,
        request_id: str,
        block_hashes: Sequence[bytes],
        num_hit_blocks: int,
        num_full_blocks: int,
        request=None,
    ) -> None:
        """Index the request's blocks that are full once this step runs, under this group's keys
        (`request`: the one whose tokens they hold, for the pool's KV events)."""
        blocks = self.req_to_blocks[request_id]
        num_cached = max(self.num_cached_blocks.get(request_id, 0), num_hit_blocks)
        keyed = group_hashes(block_hashes, self.group_id)
        self.pool.cache_full_blocks(blocks, keyed, num_cached, num_full_blocks, request)
        self.num_cached_blocks[request_id] = max(num_cached, num_full_blocks)


@dataclass
class StateCopy:
    """One step's copies of one request's state slots, which the runner makes around the forward:
    before it, `source` into the live slot (a prefix hit's snapshot, or the backup a rejected draft
    restores) and the live slot into `backup` (the state entering a step that verifies drafts); after
    it, the live slot into `target` (a new snapshot of the state after `target_key`'s block). Settled
    (`StateGroupBlocks.settle`) when the step's output is applied, or dropped when the request leaves
    the step unrun."""

    live: KVCacheBlock
    source: KVCacheBlock | None = None
    target: KVCacheBlock | None = None
    target_key: bytes | None = None
    backup: KVCacheBlock | None = None

    @property
    def copies_before(self) -> list[tuple[int, int]]:
        """(src, dst) slot pairs before the forward (never both: a hit is a prefill, drafts a decode)."""
        backup = None if self.backup is None else (self.live.block_id, self.backup.block_id)
        return [pair for pair in (self.copy_in, backup) if pair is not None]

    @property
    def copy_in(self) -> tuple[int, int] | None:
        """(snapshot slot, live slot) before the forward, or None."""
        return None if self.source is None else (self.source.block_id, self.live.block_id)

    @property
    def copy_out(self) -> tuple[int, int] | None:
        """(live slot, snapshot slot) after the forward, or None."""
        return None if self.target is None else (self.live.block_id, self.target.block_id)


class StateGroupBlocks(GroupBlocks):
    """A state group: one live slot per request, whatever its length, and snapshots of live slots at
    block boundaries, cached in the group's pool like blocks (evicted least recently used first).

    A snapshot slot is held (ref 1) from the step that fills it until that step's output is applied,
    so nothing reuses it before the copy ran; a hit's snapshot is held the same way while it is copied.
    Snapshots are best effort: one is taken only when it leaves a live slot for every request that may
    still start (`spec.num_live_slots`), and never makes an allocation fail."""

    def __init__(self, spec: CacheGroupSpec, pool: BlockPool, group_id: int):
        super().__init__(spec, pool, group_id)
        # Copies decided by allocations of the step being scheduled, until the scheduler takes them.
        self.pending: dict[str, StateCopy] = {}

    def num_new_blocks(self, request_id: str, num_slots: int, num_hit_blocks: int) -> int:
        """A live slot, unless the request holds one (a hit's snapshot is copied, never shared)."""
        return 1 if num_slots > 0 and request_id not in self.req_to_blocks else 0

    def num_pool_blocks(self, request_id: str, num_slots: int, hits: Sequence[KVCacheBlock]) -> int:
        num_new = self.num_new_blocks(request_id, num_slots, len(hits))
        return num_new + (1 if hits and hits[-1].ref_cnt == 0 else 0)

    def allocate(
        self, request_id: str, num_slots: int, hit_blocks: Sequence[KVCacheBlock]
    ) -> list[KVCacheBlock]:
        """A live slot for a request that holds none; a hit's snapshot (`hit_blocks[-1]`: the hit
        repeats it once per block) is held and copied into it before the step's forward."""
        self.num_slots[request_id] = max(num_slots, self.num_slots.get(request_id, 0))
        if not self.num_new_blocks(request_id, num_slots, 0):
            return []
        source = hit_blocks[-1] if hit_blocks else None
        if source is not None:
            self.pool.touch([source])
        new_blocks = self.pool.get_new_blocks(1)
        self.req_to_blocks[request_id] = new_blocks
        if source is not None:
            self.pending[request_id] = StateCopy(new_blocks[0], source=source)
        return list(new_blocks)

    def longest_snapshot(
        self, block_hashes: Sequence[bytes], max_num_blocks: int
    ) -> tuple[int, KVCacheBlock | None]:
        """(the longest k <= max_num_blocks such that a snapshot after block k - 1 is cached, that
        snapshot), or (0, None)."""
        keyed = group_hashes(block_hashes, self.group_id)
        for num_blocks in range(max_num_blocks, 0, -1):
            block = self.pool.get_cached_block(keyed[num_blocks - 1])
            if block is not None:
                return num_blocks, block
        return 0, None

    def take_snapshot(self, request_id: str, block_hashes: Sequence[bytes], num_blocks: int) -> None:
        """Copy the request's live slot, once this step's forward has run, into a snapshot of its
        first `num_blocks` blocks (unless one is cached, or no slot is spare)."""
        key = group_hashes(block_hashes, self.group_id)[num_blocks - 1]
        if self.pool.get_cached_block(key) is not None or not self._has_spare_slot():
            return
        copy = self.pending.setdefault(request_id, StateCopy(self.req_to_blocks[request_id][0]))
        if copy.target is None:
            copy.target, copy.target_key = self.pool.get_new_blocks(1)[0], key

    def take_backup(self, request_id: str) -> bool:
        """A slot for the state entering a step that verifies drafts (restored if one is rejected);
        False, taking nothing, when no slot is spare (the step then verifies no drafts)."""
        if not self._has_spare_slot():
            return False
        copy = self.pending.setdefault(request_id, StateCopy(self.req_to_blocks[request_id][0]))
        copy.backup = self.pool.get_new_blocks(1)[0]
        return True

    def _has_spare_slot(self) -> bool:
        free = self.pool.get_num_free_blocks()
        if self.spec.num_live_slots is None:  # the shared pool: keep one block for the next allocation
            return free >= 2
        return free - 1 >= self.spec.num_live_slots - len(self.req_to_blocks)

    def take_copy(self, request_id: str) -> StateCopy | None:
        """The copies this step makes for the request (the scheduler hands them to the runner)."""
        return self.pending.pop(request_id, None)

    def settle(self, copy: StateCopy, ran: bool, request_id: str | None = None) -> None:
        """The step carrying `copy` ran (`ran`: the request's rows were real) or was dropped: release
        the hit's snapshot, and index the new snapshot if it was written, else free it unindexed.
        `request_id`: the request rejected a draft the step verified: its backup is copied back into
        its live slot before its next forward (which recomputes the tokens after the backup)."""
        if copy.source is not None:
            self.pool.free_blocks([copy.source])
        if copy.backup is not None:
            if ran and request_id is not None:
                self.pending[request_id] = StateCopy(copy.live, source=copy.backup)
            else:
                self.pool.free_blocks([copy.backup], reuse_first=True)
        if copy.target is not None:
            is_indexed = ran and self.pool.get_cached_block(copy.target_key) is None
            if is_indexed:
                self.pool.cache_full_blocks([copy.target], [copy.target_key], 0, 1)
            self.pool.free_blocks([copy.target], reuse_first=not is_indexed)

    def free(self, request_id: str, num_valid_tokens: int | None) -> None:
        """Release the live slot, to be reused before any snapshot is evicted."""
        copy = self.pending.pop(request_id, None)  # allocated, never scheduled: nothing ran
        if copy is not None:
            self.settle(copy, ran=False)
        self.num_cached_blocks.pop(request_id, None)
        self.num_slots.pop(request_id, None)
        self.pool.free_blocks(self.req_to_blocks.pop(request_id, []), reuse_first=True)

    def block_ids(self, request_id: str) -> list[int]:
        """The live slot once per block_size tokens: the runner's slot mapping stays in the slot's own
        range (a state layer ignores it) and the table's first column is the slot."""
        blocks = self.req_to_blocks.get(request_id, [])
        if not blocks:
            return []
        num_table_blocks = max(cdiv(self.num_slots.get(request_id, 0), self.spec.block_size), 1)
        return [blocks[0].block_id] * num_table_blocks

    def cache_blocks(self, request_id, block_hashes, num_hit_blocks, num_full_blocks, request=None) -> None:
        """A live slot changes every step: only snapshots are indexed (`take_snapshot`)."""


class KVCacheCoordinator:
    """Every group's blocks for every request; allocations are all-or-nothing across groups. A state
    group with `num_slots` draws from a pool of its own (a hybrid model's state slots)."""

    def __init__(self, groups: Sequence[KVCacheGroup], pool: BlockPool):
        if not groups:
            raise ValueError("kv_cache_groups must name at least one group")
        self.groups = tuple(groups)
        self.pool = pool
        self.managers = [
            (StateGroupBlocks if group.spec.holds_state else GroupBlocks)(
                group.spec, _group_pool(group.spec, pool), index
            )
            for index, group in enumerate(self.groups)
        ]
        # The group whose live slots the step's state layers read (None: a model without one).
        self.state_manager = next((m for m in self.managers if isinstance(m, StateGroupBlocks)), None)

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
            num_taken = manager.num_pool_blocks(request_id, num_slots, group_hits)
            if manager.pool is not self.pool:  # its own slots: none free means no allocation now
                if num_taken > manager.pool.get_num_free_blocks():
                    return self.pool.num_blocks + 1
                continue
            total += num_taken
        return total

    def state_slot(self, request_id: str) -> int:
        """The request's live state slot (0, the null slot, for a model without state layers)."""
        if self.state_manager is None:
            return 0
        blocks = self.state_manager.req_to_blocks.get(request_id)
        return blocks[0].block_id if blocks else 0

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
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """(per group, the cached blocks of the longest prefix every group holds; the blocks of the
        longest prefix the groups of blocks hold, which a state group may cut short). A group's blocks
        are indexed under their own keys (`group_hashes`), so groups never hit each other's blocks. A
        state group's hit is its snapshot, once per block of the prefix."""
        hits: list = [None] * len(self.managers)
        num_hit = max_num_hit_blocks
        groups = [manager for manager in self.managers if manager is not self.state_manager]
        is_agreed = False
        while not is_agreed:  # a window's hit at a shorter length is another window: look again
            for manager in groups:
                hits[manager.group_id] = manager.longest_hit(block_hashes, num_hit)
            lengths = [len(hits[manager.group_id]) for manager in groups]
            is_agreed = min(lengths, default=num_hit) == max(lengths, default=num_hit)
            num_hit = min(lengths, default=num_hit)
        num_prefix_blocks = num_hit
        if self.state_manager is not None:
            num_hit, snapshot = self.state_manager.longest_snapshot(block_hashes, num_hit)
            hits[self.state_manager.group_id] = [snapshot] * num_hit
        return tuple(group_hits[:num_hit] for group_hits in hits), num_prefix_blocks

    def cache_blocks(
        self,
        request_id: str,
        block_hashes: Sequence[bytes],
        num_hit_blocks: int,
        num_full_blocks: int,
        request=None,
    ):
        """Index each group's blocks of the request that are full once this step runs."""
        for manager in self.managers:
            manager.cache_blocks(request_id, block_hashes, num_hit_blocks, num_full_blocks, request)


def _group_pool(spec: CacheGroupSpec, shared: BlockPool) -> BlockPool:
    """The pool a group draws from: its own when its spec sizes one (a hybrid model's state slots,
    which hold snapshots when the shared pool caches prefixes)."""
    num_slots = getattr(spec, "num_slots", None)
    return shared if num_slots is None else BlockPool(num_slots, enable_caching=shared.enable_caching)


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
