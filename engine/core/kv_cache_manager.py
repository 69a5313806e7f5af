"""Maps requests to KV cache blocks: prefix-cache lookups, slot allocation, freeing."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from xlaserve.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from xlaserve.core.limits import cdiv
from xlaserve.core.request import Request


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
    ):
        """`on_evict`: BlockPool's eviction listener (a KV connector's `on_block_evicted`)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = cdiv(max_model_len, block_size)
        self.block_pool = BlockPool(num_blocks, enable_caching, on_evict)
        self.prefix_cache_stats = PrefixCacheStats()
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already in the prefix-cache index.
        self.num_cached_blocks: dict[str, int] = {}

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
            return [], 0
        self._update_block_hashes(request)
        max_num_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit_blocks = []
        for block_hash in request.block_hashes[:max_num_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hit_blocks.append(block)
        num_hit_tokens = len(hit_blocks) * self.block_size
        self.prefix_cache_stats.record(request.num_tokens, num_hit_tokens)
        return hit_blocks, num_hit_tokens

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
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed_tokens = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_total_tokens = num_computed_tokens + num_new_tokens
        num_slots = num_total_tokens + num_lookahead_tokens
        if num_slots > self.max_blocks_per_seq * self.block_size:
            raise ValueError(
                f"request {request.request_id!r} needs {num_slots} token slots, "
                f"more than max_model_len ({self.max_model_len}) allows"
            )
        num_new_blocks = self.blocks_needed(num_slots) - len(blocks) - len(new_computed_blocks)
        # A hit on a free block takes it off the free queue, so it counts against the free blocks.
        num_evictable_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if max(num_new_blocks, 0) + num_evictable_hits > self.num_free_blocks:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None

        self.block_pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        blocks.extend(new_blocks)

        if self.enable_caching:
            num_cached = max(self.num_cached_blocks.get(request.request_id, 0), len(new_computed_blocks))
            num_full_blocks = min(num_total_tokens, request.num_tokens) // self.block_size
            self._update_block_hashes(request)
            self.block_pool.cache_full_blocks(blocks, request.block_hashes, num_cached, num_full_blocks)
            self.num_cached_blocks[request.request_id] = max(num_cached, num_full_blocks)
        return new_blocks

    def free(self, request: Request, num_valid_tokens: int | None = None) -> None:
        """Release the request's blocks, tail first so a sequence's tail is evicted before its head.

        `num_valid_tokens`: when the request is dropped before a scheduled step wrote its K/V
        (preempted in the same step), only that many tokens' blocks hold real K/V; blocks past
        them leave the prefix-cache index so nobody hits unwritten slots.
        """
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        if num_valid_tokens is not None:
            self.block_pool.uncache_blocks(blocks[num_valid_tokens // self.block_size :])
        self.block_pool.free_blocks(reversed(blocks))

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's blocks, in token order."""
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table: block ids in token order."""
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Snapshot the prefix-cache stats and start counting afresh."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (e.g. after weights change)."""
        is_reset = self.block_pool.reset_prefix_cache()
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
            block_hashes.append(
                hash_block_tokens(parent_hash, tokens[start : start + self.block_size], extra_keys)
            )


def skips_prefix_cache(request: Request) -> bool:
    """A request whose prompt must all run through the model: prompt logprobs need every position's
    logits. No cached K/V serves it, from the device or any other tier."""
    return request.sampling_params.prompt_logprobs is not None


def _first_block_keys(request: Request) -> tuple | None:
    """What separates otherwise identical prefixes: the cache salt, and the LoRA adapter (its K/V
    differ from the base model's wherever it targets k_proj or v_proj, or any earlier layer)."""
    keys: tuple = () if request.cache_salt is None else (request.cache_salt,)
    if request.lora_request is not None:
        keys += (("lora", request.lora_request.lora_int_id, request.lora_request.lora_name),)
    return keys or None
