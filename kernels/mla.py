"""Multi-head Latent Attention (DeepSeek V2/V3) over a paged latent cache: the reference, in pure jnp.

MLA caches, per token and layer, one vector of ``kv_lora_rank + qk_rope_head_dim`` numbers: the
normalized compressed KV latent ``c`` and the rotated key part ``k_pe`` that all heads share. Full
keys and values are never cached: head h's key is ``W_uk[h] @ c`` (plus ``k_pe``) and its value
``W_uv[h] @ c``. Folding ``W_uk[h]`` into the query ("weight absorption")

    q_nope[h] . (W_uk[h] @ c) = (W_uk[h]^T q_nope[h]) . c

turns MLA into multi-query attention with one shared head of dim ``kv_lora_rank + rope_dim``
whose value is the latent itself: this op takes the absorbed query, attends over the latent
cache, and returns each head's attention-weighted latent [T, H, kv_lora_rank]; the caller applies
``W_uv`` after it. A prefill chunk and a decode token run the same way, as in
kernels/reference.py (whose token bookkeeping this op shares): memory is bounded by
T x tokens_per_chunk, and the loop's trip count is set by the longest context in the step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from xlaserve.kernels.invariant import invariant_sum
from xlaserve.kernels.reference import DEFAULT_TOKENS_PER_CHUNK, token_positions


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MLACache:
    """The paged latent cache of every layer, donated into each step.

    One array (no separate K and V): ``[num_layers * num_blocks, block_size, 1, kv_lora_rank +
    qk_rope_head_dim]``, the last axis holding ``concat(c, k_pe)``. The singleton axis is the one
    "KV head" every query head shares, so the layout (and its block offsets per layer, see
    AttentionMetadata.for_layer) is the paged K cache's.
    """

    latent: jax.Array


def write_latent(
    latent_cache: jax.Array,  # [num_blocks, block_size, 1, kv_lora_rank + rope_dim]
    latent: jax.Array,  # [T, kv_lora_rank + rope_dim]
    slot_mapping: jax.Array,  # [T] int32: block_id * block_size + offset (padding: the null block)
    *,
    positions: jax.Array | None = None,
) -> jax.Array:
    """Scatter this step's latents into their cache slots. `positions` [T] (the tokens' positions) is
    not read here: a decode-context-parallel cache (sharding/context_parallel.py) writes each token on
    the rank its position names, as `AttentionBackend.write_latent`."""
    block_size = latent_cache.shape[1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    return latent_cache.at[blocks, offsets, 0].set(latent.astype(latent_cache.dtype))


def check_mla_shapes(q_latent, q_rope, latent_cache) -> tuple[int, int, int, int]:
    """The shapes every MLA path takes (q_latent [T >= 1, H, kv_lora_rank], q_rope [T, H, rope_dim],
    latent_cache [num_blocks, block_size, 1, kv_lora_rank + rope_dim]): (T, H, kv_lora_rank, rope_dim),
    or a ValueError naming the argument."""
    if q_latent.ndim != 3 or q_latent.shape[0] < 1:
        raise ValueError(f"q_latent must be [num_tokens >= 1, num_heads, kv_lora_rank], got {q_latent.shape}")
    num_tokens, num_heads, rank = q_latent.shape
    if q_rope.ndim != 3 or q_rope.shape[:2] != (num_tokens, num_heads):
        raise ValueError(f"q_rope must be [{num_tokens}, {num_heads}, rope_dim], got {q_rope.shape}")
    rope_dim = q_rope.shape[2]
    if latent_cache.ndim != 4 or latent_cache.shape[2] != 1 or latent_cache.shape[3] != rank + rope_dim:
        raise ValueError(
            f"latent_cache must be [num_blocks, block_size, 1, {rank + rope_dim}] for kv_lora_rank={rank} "
            f"and rope_dim={rope_dim}, got {latent_cache.shape}"
        )
    return num_tokens, num_heads, rank, rope_dim


def mla_paged_attention(
    q_latent: jax.Array,  # [T, H, kv_lora_rank]: W_uk^T q_nope per head (the absorbed query)
    q_rope: jax.Array,  # [T, H, rope_dim]: the rotated query part
    latent_cache: jax.Array,  # [num_blocks, block_size, 1, kv_lora_rank + rope_dim]
    kv_lens: jax.Array,  # [R] int32: context length including this step's tokens
    block_tables: jax.Array,  # [R, max_blocks_per_seq] int32
    query_start_loc: jax.Array,  # [R + 1] int32
    num_seqs: jax.Array,  # [] int32
    *,
    sm_scale: float,
    tokens_per_chunk: int = DEFAULT_TOKENS_PER_CHUNK,
) -> jax.Array:  # [T, H, kv_lora_rank]
    """Causal MLA of each new token over its sequence's paged latent context.

    Scores are ``sm_scale * (q_latent . c + q_rope . k_pe)``; the output is the softmax-weighted
    sum of the latents ``c`` (apply ``W_uv`` per head to get the values' output). Padding tokens
    (past ``query_start_loc[num_seqs]``) get zeros.
    """
    check_mla_shapes(q_latent, q_rope, latent_cache)
    return _mla_paged_attention(
        q_latent,
        q_rope,
        latent_cache,
        kv_lens,
        block_tables,
        query_start_loc,
        num_seqs,
        sm_scale,
        tokens_per_chunk,
    )


def _mla_paged_attention(
    q_latent,
    q_rope,
    latent_cache,
    kv_lens,
    block_tables,
    query_start_loc,
    num_seqs,
    sm_scale,
    tokens_per_chunk,
):
    num_tokens, num_heads, rank = q_latent.shape
    _, block_size, _, latent_dim = latent_cache.shape
    num_padded_seqs, max_blocks = block_tables.shape
    pages_per_chunk = max(1, min(max_blocks, tokens_per_chunk // block_size))
    chunk_len = pages_per_chunk * block_size

    seq, position, is_real = token_positions(num_tokens, kv_lens, query_start_loc, num_seqs)
    padded_blocks = -(-max_blocks // pages_per_chunk) * pages_per_chunk
    tables = jnp.pad(block_tables, ((0, 0), (0, padded_blocks - max_blocks)))[seq]  # [T, padded_blocks]
    is_real_seq = jnp.arange(num_padded_seqs) < num_seqs
    longest = jnp.max(jnp.where(is_real_seq, kv_lens, 0))
    num_chunks = (longest + chunk_len - 1) // chunk_len

    q_thc = jnp.concatenate([q_latent, q_rope], axis=-1).astype(jnp.float32) * sm_scale

    def chunk(i, carry):
        m_th, l_th, acc_thr = carry
        pages = jax.lax.dynamic_slice_in_dim(tables, i * pages_per_chunk, pages_per_chunk, axis=1)
        c_tsc = latent_cache[pages].reshape(num_tokens, chunk_len, latent_dim).astype(jnp.float32)
        kv_pos = i * chunk_len + jnp.arange(chunk_len)
        visible = (kv_pos[None, :] <= position[:, None]) & is_real[:, None]  # [T, S]
        # Masked slots may hold anything (a reused block's stale values, NaN included).
        c_tsc = jnp.where(visible[:, :, None], c_tsc, 0.0)
        s_ths = jnp.einsum("thc,tsc->ths", q_thc, c_tsc)
        s_ths = jnp.where(visible[:, None, :], s_ths, -jnp.inf)
        m_new = jnp.maximum(m_th, s_ths.max(axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a fully masked row stays at zero
        p_ths = jnp.exp(s_ths - m_safe[..., None])
        alpha = jnp.exp(m_th - m_safe)
        l_th = alpha * l_th + invariant_sum(p_ths)  # XLA's sum over S rounds by the whole [T, H, S] shape
        acc_thr = alpha[..., None] * acc_thr + jnp.einsum("ths,tsr->thr", p_ths, c_tsc[..., :rank])
        return m_new, l_th, acc_thr

    init = (
        jnp.full((num_tokens, num_heads), -jnp.inf, jnp.float32),
        jnp.zeros((num_tokens, num_heads), jnp.float32),
        jnp.zeros((num_tokens, num_heads, rank), jnp.float32),
    )
    _, l_th, acc_thr = jax.lax.fori_loop(0, num_chunks, chunk, init)
    out = acc_thr / jnp.where(l_th == 0.0, 1.0, l_th)[..., None]
    return out.astype(q_latent.dtype)
