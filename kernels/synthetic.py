"""Random ragged paged attention steps, laid out as the engine lays them out, for self-checks and benches.

The tests have their own float64 oracle and case generator (tests/helpers/attention_cases.py); this one is
for code that runs on the device: the backend self-check and `python -m xlaserve.entrypoints.bench.attention`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class StepShape:
    """Sequences as (context length after the step, new tokens), and the heads of the model."""

    seqs: tuple[tuple[int, int], ...]
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    block_size: int = 16
    num_tokens: int | None = None  # T (padded); default: the real tokens
    num_padded_seqs: int | None = None  # R; default: the real sequences

    @property
    def num_real_tokens(self) -> int:
        return sum(n for _, n in self.seqs)

    def kv_bytes_read(self) -> int:
        """Bytes of K and V the step must read at least: every sequence's context, once per KV head."""
        itemsize = jnp.dtype(self.dtype).itemsize
        return 2 * sum(ctx for ctx, _ in self.seqs) * self.num_kv_heads * self.head_dim * itemsize

    def attention_flops(self) -> int:
        """2 matmuls x 2 flops per multiply-add, over the (causal) visible pairs of every new token."""
        visible = sum(sum(ctx - n + i + 1 for i in range(n)) for ctx, n in self.seqs)
        return 4 * visible * self.num_q_heads * self.head_dim


def synthetic_step(shape: StepShape, seed: int = 0) -> tuple:
    """-> (q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs) on the default device.

    Blocks are shuffled and non-contiguous; block 0 is the null block (padding table entries); the
    cache holds exactly the blocks the sequences need, plus the null block.
    """
    rng = np.random.default_rng(seed)
    bs = shape.block_size
    num_real_seqs = len(shape.seqs)
    num_padded_seqs = shape.num_padded_seqs or max(num_real_seqs, 1)
    num_tokens = shape.num_tokens or max(shape.num_real_tokens, 1)
    blocks_per_seq = [-(-ctx // bs) for ctx, _ in shape.seqs]
    max_blocks = max(blocks_per_seq, default=1)
    num_blocks = 1 + sum(blocks_per_seq)
    ids = rng.permutation(np.arange(1, num_blocks, dtype=np.int32))
    block_tables = np.zeros((num_padded_seqs, max_blocks), np.int32)
    kv_lens = np.zeros(num_padded_seqs, np.int32)
    query_start_loc = np.zeros(num_padded_seqs + 1, np.int32)
    used = 0
    for row, ((ctx, n), nb) in enumerate(zip(shape.seqs, blocks_per_seq)):
        block_tables[row, :nb] = ids[used : used + nb]
        used += nb
        kv_lens[row] = ctx
        query_start_loc[row + 1] = query_start_loc[row] + n
    query_start_loc[num_real_seqs + 1 :] = query_start_loc[num_real_seqs]

    key_q, key_k, key_v = jax.random.split(jax.random.key(seed), 3)
    dtype = jnp.dtype(shape.dtype)
    cache_shape = (num_blocks, bs, shape.num_kv_heads, shape.head_dim)
    return (
        jax.random.normal(key_q, (num_tokens, shape.num_q_heads, shape.head_dim), dtype),
        jax.random.normal(key_k, cache_shape, dtype),
        jax.random.normal(key_v, cache_shape, dtype),
        jnp.asarray(kv_lens),
        jnp.asarray(block_tables),
        jnp.asarray(query_start_loc),
        jnp.int32(num_real_seqs),
    )
