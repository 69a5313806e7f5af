"""Maps requests to KV cache blocks: prefix-cache lookups, slot allocation, freeing."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from xlaserve.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from xlaserve.core.kv_cache_coordinator import KVCacheCoordinator, StateCopy
from xlaserve.core.kv_cache_spec import KVCacheGroup, SlidingWindowSpec, context_blocks, full_attention_groups
from xlaserve.core.kv_events import KVCacheEvent, KVEventRecorder
from xlaserve.core.limits import cdiv
from xlaserve.core.multimodal import mm_block_keys
from xlaserve.core.request import Request
from xlaserve.pooling_params import TOKEN_TASKS


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the last reset, counted in tokens (like vLLM's)."""

    num_requests: int = 0
    num_queries: int = 0  # tokens looked up
    num_hits: int = 0  # tokens found cached
    is_reset: bool = False  # the cache was reset since the last snapshot

    @property
    def hit_rate(self) -> float:
        """Hit tokens over queried tokens (0 when nothing was queried)."""
        return self.num_hits / self.num_queries if self.num_queries else 0.0

    def record(self, num_queries: int, num_hits: int) -> None:
        """Count one request's lookup."""
        self.num_requests += 1
        self.num_queries += num_queries
        self.num_hits += num_hits

    def reset(self) -> None:
        """Zero the counters."""
        self.num_requests = self.num_queries = self.num_hits = 0
        self.is_reset = False


class KVCacheManager:
    """Gives each request the blocks its tokens need and finds cached prefixes.

    A request's blocks are a list whose i-th entry holds tokens [i*block_size, (i+1)*block_size);
    the model runner receives their ids as the request's block table.
    """

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        enable_caching: bool = True,
        max_model_len: int = 2048,
        on_evict: Callable[[bytes, int], None] | None = None,
        kv_cache_groups: Sequence[KVCacheGroup] | None = None,
        enable_kv_cache_events: bool = False,
    ):
        """`on_evict`: BlockPool's eviction listener (a KV connector's `on_block_evicted`).
        `kv_cache_groups`: the model's layer groups (core/kv_cache_spec.py); None: one full-attention
        group. A group that keeps a state caches prefixes through snapshots of its state at block
        boundaries (core/kv_cache_coordinator.py `StateGroupBlocks`). `enable_kv_cache_events`: record
        what the prefix cache stores and removes (core/kv_events.py) for `take_events`."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        groups = tuple(kv_cache_groups or full_attention_groups(block_size, 1))
        for group in groups:
            if group.spec.block_size != block_size:
                raise ValueError(
                    f"kv_cache_groups: a group's block_size ({group.spec.block_size}) must equal "
                    f"block_size ({block_size})"
                )
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = cdiv(max_model_len, block_size)
        kv_events = None
        if enable_kv_cache_events and enable_caching:
            kv_events = KVEventRecorder(block_size, _event_groups(groups))
        self.block_pool = BlockPool(num_blocks, enable_caching, on_evict, kv_events)
        self.coordinator = KVCacheCoordinator(groups, self.block_pool)
        self.kv_cache_groups = groups
        # A state group's snapshots are taken where a step ends, so a prompt's chunks are cut at its
        # snapshot points (`_snapshot_points`, `align_chunk`).
        self.snapshots_states = enable_caching and self.coordinator.state_manager is not None
        # Where a request's prefix left the cached blocks' (a branch point of the prefix tree) while the
        # snapshots reached less: its prefill stops there once, so the next such request hits it.
        self._branch_points: dict[str, int] = {}
        # Blocks of block_size tokens one request's context may span (a state-only model: any length).
        self.num_context_blocks = context_blocks(groups, self.num_usable_blocks, max_model_len)
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]:
        """The first group's blocks per request (a one-group model's only ones)."""
        return self.coordinator.managers[0].req_to_blocks

    @property
    def num_cached_blocks(self) -> dict[str, int]:
        """How many leading blocks of each request (first group) are in the prefix-cache index."""
        return self.coordinator.managers[0].num_cached_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        """Blocks available to allocate (evictable cached blocks included)."""
        return self.block_pool.get_num_free_blocks()

    @property
    def num_usable_blocks(self) -> int:
        """All blocks but the null block."""
        return self.block_pool.num_usable_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return cdiv(num_tokens, self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of `request`: (its blocks, its length in tokens).

        At most num_tokens - 1 tokens hit, rounded down to whole blocks, because the last
        token must still run through the model to produce logits. Requests asking for prompt
        logprobs skip the cache: those need logits for every prompt token.
        """
        if not self.enable_caching or skips_prefix_cache(request):
            return self._from_groups(tuple([] for _ in self.kv_cache_groups)), 0
        hits, num_prefix_blocks = self._find_cache_hit(request)
        num_hit_tokens = len(hits[0]) * self.block_size
        if num_prefix_blocks > len(hits[0]):
            self._branch_points[request.request_id] = num_prefix_blocks * self.block_size
        self.prefix_cache_stats.record(request.num_tokens, num_hit_tokens)
        return self._from_groups(hits), num_hit_tokens

    def num_cached_tokens(self, request: Request) -> int:
        """The tokens `get_computed_blocks` would hit now, with nothing recorded or held (a consumer
        asks before it fetches a prompt's blocks from a producer: those it holds are not fetched)."""
        if not self.enable_caching or skips_prefix_cache(request):
            return 0
        return len(self._find_cache_hit(request)[0][0]) * self.block_size

    def num_cacheable_tokens(self, request: Request) -> int:
        """The prompt's tokens the prefix cache holds once it is computed: its whole blocks (those a hit
        found, and those it adds: vLLM's cache creation). A request that skips the cache's hits still
        writes its blocks, and vLLM counts them; so does a block another copy already holds (vLLM's pool
        indexes both, ours the first)."""
        if not self.enable_caching:
            return 0
        return request.num_prompt_tokens // self.block_size * self.block_size

    def _find_cache_hit(self, request: Request):
        self._update_block_hashes(request)
        max_num_hit_blocks = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        return self.coordinator.find_longest_cache_hit(request.block_hashes, max_num_hit_blocks)

    def _snapshot_points(self, request: Request) -> tuple[int, int]:
        """Where a state group snapshots the request's state: its branch point (the end of the prefix
        it shares with cached requests, where another request sharing it will hit), and the last block
        boundary before its prompt's last token (the longest prefix a later request can hit: its next
        turn). Only these two, so that a pool of few snapshot slots keeps the ones worth keeping."""
        last = (request.num_prompt_tokens - 1) // self.block_size * self.block_size
        return self._branch_points.get(request.request_id, 0), last

    def align_chunk(self, request: Request, start: int, num_new_tokens: int) -> int:
        """The tokens of a prefill chunk from `start`, cut at a snapshot point inside it (a snapshot is
        taken only where a step ends). Unchanged without state snapshots."""
        if not self.snapshots_states or skips_prefix_cache(request):
            return num_new_tokens
        for stop in self._snapshot_points(request):
            if start < stop < start + num_new_tokens:
                return stop - start
        return num_new_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Grow the request's blocks to hold its computed tokens plus `num_new_tokens`.

        `new_computed_blocks` are prefix-cache hits (from get_computed_blocks) not yet counted
        in `request.num_computed_tokens`; they are referenced, not recomputed. Returns the newly
        allocated blocks (possibly empty), or None, changing nothing, when too few are free.

        Blocks that will be full once this step runs are indexed right away, so requests
        scheduled later in the same step can hit them: the model writes each layer's K/V for
        the whole batch before that layer's attention reads it.

        `num_lookahead_tokens` (vLLM's name): slots past the new tokens that the step may write
        (a draft model's proposals); allocated, never counted as computed, never cached.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        hits = self._to_groups(new_computed_blocks)
        num_computed_tokens = request.num_computed_tokens + len(hits[0]) * self.block_size
        num_total_tokens = num_computed_tokens + num_new_tokens
        num_slots = num_total_tokens + num_lookahead_tokens
        if num_slots > self.max_blocks_per_seq * self.block_size:
            raise ValueError(
                f"request {request.request_id!r} needs {num_slots} token slots, "
                f"more than max_model_len ({self.max_model_len}) allows"
            )
        coordinator = self.coordinator
        # A sliding window's blocks that no query reads again go back first: they count as free below.
        coordinator.remove_dead_blocks(request.request_id, request.num_computed_tokens)
        if coordinator.num_blocks_to_allocate(request.request_id, num_slots, hits) > self.num_free_blocks:
            return None
        new_blocks = coordinator.allocate(request.request_id, num_slots, hits)

        if self.enable_caching:
            num_full_blocks = min(num_total_tokens, request.num_tokens) // self.block_size
            self._update_block_hashes(request)
            coordinator.cache_blocks(
                request.request_id, request.block_hashes, len(hits[0]), num_full_blocks, request
            )
            if (
                self.snapshots_states
                and num_total_tokens > 0
                and num_total_tokens in self._snapshot_points(request)
                and not skips_prefix_cache(request)
            ):  # the state after a block of the prompt: a later request's hit
                num_blocks = num_total_tokens // self.block_size
                coordinator.state_manager.take_snapshot(request.request_id, request.block_hashes, num_blocks)
        return self._from_groups(new_blocks)

    def take_state_copy(self, request_id: str) -> StateCopy | None:
        """The state-slot copies the step being scheduled makes for the request (None: none)."""
        manager = self.coordinator.state_manager
        return None if manager is None else manager.take_copy(request_id)

    def take_state_backup(self, request_id: str) -> bool:
        """Before a step verifies the request's drafts: keep the state entering it, to restore if a
        draft is rejected. True when kept, or when the model keeps no state; False: no slot is spare."""
        manager = self.coordinator.state_manager
        return manager is None or manager.take_backup(request_id)

    def settle_state_copy(self, copy: StateCopy, ran: bool, restore_for: str | None = None) -> None:
        """The step carrying `copy` ran (`ran`: with the request's real rows) or never will.
        `restore_for`: the request id whose rejected drafts need the step's backup restored."""
        self.coordinator.state_manager.settle(copy, ran, restore_for)

    def free(self, request: Request, num_valid_tokens: int | None = None) -> None:
        """Release the request's blocks, tail first so a sequence's tail is evicted before its head.

        `num_valid_tokens`: when the request is dropped before a scheduled step wrote its K/V
        (preempted in the same step), only that many tokens' blocks hold real K/V; blocks past
        them leave the prefix-cache index so nobody hits unwritten slots.
        """
        self.coordinator.free(request.request_id, num_valid_tokens)
        self._branch_points.pop(request.request_id, None)

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's blocks, in token order."""
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table: block ids in token order (the first group's)."""
        return self.coordinator.managers[0].block_ids(request_id)

    def get_window_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The block tables of the attention groups after the first (a model whose layers slide by
        several windows: worker/kv_cache_groups.py `window_groups`); () for any other model."""
        return tuple(
            manager.block_ids(request_id)
            for manager in self.coordinator.managers[1:]
            if not manager.spec.holds_state
        )

    def get_state_slot(self, request_id: str) -> int:
        """The request's state slot (a state group's one block), 0 for a model without state layers."""
        return self.coordinator.state_slot(request_id)

    def get_group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table in every group, in `kv_cache_groups` order."""
        return tuple(manager.block_ids(request_id) for manager in self.coordinator.managers)

    def _to_groups(self, blocks) -> tuple[Sequence[KVCacheBlock], ...]:
        if isinstance(blocks, GroupedBlocks):
            return blocks.groups
        if len(self.kv_cache_groups) == 1:
            return (blocks,)
        if blocks:
            raise ValueError(
                "new_computed_blocks of a model with several KV cache groups must be GroupedBlocks"
            )
        return tuple(() for _ in self.kv_cache_groups)

    def _from_groups(self, groups: tuple[list[KVCacheBlock], ...]):
        """One group: its list, as the scheduler has always received it; several: `GroupedBlocks`."""
        return groups[0] if len(groups) == 1 else GroupedBlocks(groups)

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Snapshot the prefix-cache stats and start counting afresh."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def cached_blocks(self) -> list[tuple[bytes, int]]:
        """Every block the prefix cache indexes, as (hash, block id), the least recently cached first."""
        return [(h, block.block_id) for h, block in self.block_pool.cached_block_hash_to_block.items()]

    def take_events(self) -> list[KVCacheEvent]:
        """The KV cache events recorded since the last call ([] with events off)."""
        recorder = self.block_pool.kv_events
        return [] if recorder is None else recorder.take()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (e.g. after weights change). Blocks running requests hold keep
        their K/V: each such request indexes its full blocks again from its first at its next step, so
        the index (and the BlockStored a router hears after AllBlocksCleared) never holds a block whose
        prefix it has forgotten."""
        is_reset = self.block_pool.reset_prefix_cache()
        for manager in self.coordinator.managers:
            manager.num_cached_blocks.clear()
        state_manager = self.coordinator.state_manager
        if state_manager is not None and state_manager.pool is not self.block_pool:  # its snapshots
            state_manager.pool.reset_prefix_cache()
        if is_reset:
            self.prefix_cache_stats.is_reset = True
        return is_reset

    def _update_block_hashes(self, request: Request) -> None:
        # Hash only the blocks that filled up since the last call: each block is hashed once.
        block_hashes = request.block_hashes
        tokens = request.all_token_ids
        for index in range(len(block_hashes), request.num_tokens // self.block_size):
            parent_hash = block_hashes[-1] if block_hashes else None
            # The salt and the adapter enter the first block only; chaining carries them into every
            # later hash. Keys of the base model without a salt stay as they were.
            extra_keys = _first_block_keys(request) if index == 0 else None
            start = index * self.block_size
            # The content hash of each image whose placeholders the block holds (core/multimodal.py).
            mm_keys = mm_block_keys(request.mm_features, start, start + self.block_size)
            extra_keys = ((extra_keys or ()) + mm_keys) or None
            block_hashes.append(
                hash_block_tokens(parent_hash, tokens[start : start + self.block_size], extra_keys)
            )


class GroupedBlocks:
    """Blocks of every group (a model with several): `len()` counts the first group's, which is the
    hit length in blocks the scheduler reads (every cacheable group hits the same prefix)."""

    def __init__(self, groups: tuple[list[KVCacheBlock], ...]):
        self.groups = groups

    def __len__(self) -> int:
        return len(self.groups[0])

    def __repr__(self) -> str:
        return f"GroupedBlocks({self.groups!r})"


def skips_prefix_cache(request: Request) -> bool:
    """A request whose prompt must all run through the model: prompt logprobs need every position's
    logits, a token-level pooling task every position's hidden state. No cached K/V serves it, from
    the device or any other tier."""
    pooling = request.pooling_params
    return request.sampling_params.prompt_logprobs is not None or (
        pooling is not None and pooling.task in TOKEN_TASKS
    )


def _event_groups(groups: Sequence[KVCacheGroup]) -> dict[int, tuple[str, int | None]]:
    """The groups whose blocks hold tokens, as KV events describe them (vLLM's kinds)."""
    described = {}
    for index, group in enumerate(groups):
        if group.spec.holds_state:
            continue
        is_window = isinstance(group.spec, SlidingWindowSpec)
        described[index] = (
            ("sliding_window", group.spec.sliding_window) if is_window else ("full_attention", None)
        )
    return described


def _first_block_keys(request: Request) -> tuple | None:
    """What separates otherwise identical prefixes: the cache salt, and the LoRA adapter (its K/V
    differ from the base model's wherever it targets k_proj or v_proj, or any earlier layer)."""
    keys: tuple = () if request.cache_salt is None else (request.cache_salt,)
    if request.lora_request is not None:
        keys += (("lora", request.lora_request.lora_int_id, request.lora_request.lora_name),)
    return keys or None
