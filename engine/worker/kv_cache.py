"""KV cache allocation: how many blocks the memory budget holds, and the preallocated cache."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from xlaserve.config import CacheConfig
from xlaserve.kernels import KVCache, KVCacheSpec
from xlaserve.sharding import Placement

logger = logging.getLogger(__name__)

# On CPU no device reports its memory: the budget is `kv_cache_memory` bytes, or this.
DEFAULT_CPU_KV_CACHE_MEMORY = 512 * 2**20


def bytes_per_block(kv_spec: KVCacheSpec, block_size: int, dtype) -> int:
    return kv_spec.bytes_per_block(block_size, jnp.dtype(dtype).itemsize)


def num_kv_blocks(
    cache: CacheConfig,
    kv_spec: KVCacheSpec,
    dtype,
    extra_bytes_per_block: int = 0,
    cache_block_size: int | None = None,
) -> int:
    """The blocks the budget holds: `num_gpu_blocks_override`, else `kv_cache_memory` bytes, else
    (GPU) `gpu_memory_utilization` of the device's memory less what is in use, else (CPU) 512 MiB.
    `extra_bytes_per_block`: another cache indexed by the same block ids (a draft model's) shares it.
    `cache_block_size`: the device cache's slots per block, when fewer than the scheduler's block_size
    (decode context parallel: a block's tokens spread over ranks)."""
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    if kv_spec.fixed_num_tokens is not None:  # a placeholder cache (an encoder's): 1 + the null block
        return -(-kv_spec.fixed_num_tokens // cache.block_size) + 1
    if cache.kv_cache_memory is not None:
        budget = cache.kv_cache_memory
    elif jax.default_backend() == "cpu":
        budget = DEFAULT_CPU_KV_CACHE_MEMORY
    else:
        stats = jax.local_devices()[0].memory_stats() or {}
        limit = stats.get("bytes_limit", 0)
        budget = int(limit * cache.gpu_memory_utilization) - stats.get("bytes_in_use", 0)
    block_bytes = (
        bytes_per_block(kv_spec, cache_block_size or cache.block_size, dtype) + extra_bytes_per_block
    )
    fixed_bytes = kv_spec.fixed_bytes(jnp.dtype(dtype).itemsize)  # a hybrid model's state slots come first
    if fixed_bytes and fixed_bytes + 2 * block_bytes > budget:
        raise ValueError(
            f"the per-request state of max_num_seqs requests takes {fixed_bytes} bytes of the KV cache "
            f"budget of {budget} bytes, leaving too little for attention blocks; lower max_num_seqs "
            "(--max-num-seqs) or raise kv_cache_memory/gpu_memory_utilization"
        )
    budget -= fixed_bytes
    num_blocks = budget // block_bytes
    if num_blocks < 2:
        raise ValueError(
            f"the KV cache budget of {budget} bytes holds {num_blocks} blocks of "
            f"{block_bytes} bytes; at least 2 are needed (raise kv_cache_memory)"
        )
    return int(num_blocks)


def fit_state_copy_slots(kv_spec, config, dtype, cache_block_size: int, user_max_model_len: int | None):
    """`kv_spec` with a hybrid model's copy slots (prefix-cache snapshots, drafts' backups) halved until
    the cache budget holds them beside the live slots and the blocks of one request of
    `user_max_model_len` (None: two blocks; the engine then fits max_model_len to the cache): a budget
    that served the model without them still does, with fewer snapshots (logged)."""
    num_needed = 2
    if user_max_model_len is not None:  # one request of it, and the null block
        num_needed = -(-user_max_model_len // config.cache.block_size) + 1
    while getattr(kv_spec, "num_state_snapshots", 0):
        try:
            if num_kv_blocks(config.cache, kv_spec, dtype, cache_block_size=cache_block_size) >= num_needed:
                break
        except ValueError:  # the slots leave less than two blocks: fewer slots, below
            pass
        fewer = kv_spec.num_state_snapshots // 2
        logger.warning(
            "the KV cache budget does not hold %d state snapshot slots beside the live ones and a request "
            "of max_model_len: %d (fewer prefix-cache snapshots and drafts' backups)",
            kv_spec.num_state_snapshots,
            fewer,
        )
        kv_spec = kv_spec.with_max_num_seqs(config.scheduler.max_num_seqs, fewer)
    return kv_spec


def fit_max_model_len(
    max_model_len: int, num_usable_blocks: int, block_size: int, *, is_user_set: bool
) -> int:
    """The context length the KV cache can serve: `max_model_len`, or, when the user did not set it,
    lowered to what the cache holds (logged). A user's max_model_len the cache cannot hold is a
    ValueError naming both numbers and the flags to change: otherwise the engine would start,
    advertise the length, and reject every request that needs it."""
    num_cache_tokens = num_usable_blocks * block_size
    if max_model_len <= num_cache_tokens:
        return max_model_len
    if is_user_set:
        raise ValueError(
            f"max_model_len ({max_model_len}) is larger than the maximum number of tokens that can be "
            f"stored in KV cache ({num_cache_tokens}: {num_usable_blocks} blocks of {block_size} tokens). "
            "Try increasing gpu_memory_utilization/kv_cache_memory (--gpu-memory-utilization, "
            "--kv-cache-memory) or decreasing max_model_len (--max-model-len)"
        )
    logger.warning(
        "max_model_len lowered from %d (the model's) to %d: the KV cache holds only %d blocks of %d tokens; "
        "raise gpu_memory_utilization/kv_cache_memory for longer contexts",
        max_model_len,
        num_cache_tokens,
        num_usable_blocks,
        block_size,
    )
    return num_cache_tokens


def allocate_kv_cache(
    kv_spec: KVCacheSpec, num_blocks: int, block_size: int, dtype, placement: Placement
) -> KVCache:
    """The zeroed cache, sharded by KV heads (MLA's one latent head: replicated, or interleaved over the
    ranks under decode context parallel), a recurrent layer's
    state by channel and head (sharding/rules.py STATE_CACHE_AXES)."""
    logger.info(
        "KV cache: %d blocks of %d tokens (%.1f MiB)",
        num_blocks,
        block_size,
        num_blocks * bytes_per_block(kv_spec, block_size, dtype) / 2**20,
    )
    sharding = placement.kv_cache_sharding()
    if kv_spec.num_kv_heads % placement.mesh.shape["tensor"]:
        sharding = placement.replicated

    def zeros(shape, array_dtype=dtype, kind: str = "kv"):
        # kind: "kv" (K, V, MLA's latent), or a recurrent layer's "conv_state" / "recurrent_state"
        where = sharding if kind == "kv" else placement.state_cache_sharding(kind)
        return placement.zeros(shape, array_dtype, where)

    return kv_spec.allocate(num_blocks, block_size, zeros)
