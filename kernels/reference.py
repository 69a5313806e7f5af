"""Reference paged attention over the flat ragged batch, in pure jnp: the spec and the CPU path.

One step holds T new tokens from R sequences laid end to end (``query_start_loc``). The new tokens
of a sequence are the last positions of its context (``kv_lens``), so a prefill chunk and a decode
token are the same thing to this op: queries at known positions, attending causally to the cache.

Memory stays bounded by T x chunk instead of T x max_model_len: a loop walks the block tables a few
pages at a time with an online softmax, and its trip count is set by the longest context in the
step (a dynamic bound), so short batches never touch the padded tail of the block tables.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from xlaserve.kernels.dtype_ops import as_words, from_words, is_16bit_float

DEFAULT_TOKENS_PER_CHUNK = 64


def write_kv(
    k_cache: jax.Array,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: jax.Array,  # [num_blocks, block_size, num_kv_heads, head_dim]
    k: jax.Array,  # [T, num_kv_heads, head_dim]
    v: jax.Array,  # [T, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # [T] int32: block_id * block_size + offset
) -> tuple[jax.Array, jax.Array]:
    """Scatter this step's keys and values into their cache slots (padding goes to the null block)."""
    block_size = k_cache.shape[1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size

    def write(cache, new):
        if cache.dtype == jnp.uint16:  # a cache of 16-bit floats stored as words (dtype_ops.py)
            if not is_16bit_float(new.dtype):
                raise TypeError(f"a cache of 16-bit words takes 16-bit float keys/values, got {new.dtype}")
            return cache.at[blocks, offsets].set(as_words(new))
        return cache.at[blocks, offsets].set(new.astype(cache.dtype))

    return write(k_cache, k), write(v_cache, v)


def token_positions(
    num_tokens: int, kv_lens: jax.Array, query_start_loc: jax.Array, num_seqs: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per token of the flat batch: its sequence, its absolute position, and whether it is real."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    num_padded_seqs = kv_lens.shape[0]
    # The sequence of token t is the number of sequence ends at or before t.
    seq = jnp.searchsorted(query_start_loc[1:], t, side="right").astype(jnp.int32)
    seq = jnp.minimum(seq, num_padded_seqs - 1)
    is_real = t < query_start_loc[num_seqs]
    position = kv_lens[seq] - (query_start_loc[seq + 1] - t)
    return seq, position, is_real


def ragged_paged_attention(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    k_cache: jax.Array,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: jax.Array,  # [num_blocks, block_size, num_kv_heads, head_dim]
    kv_lens: jax.Array,  # [R] int32: context length including this step's tokens
    block_tables: jax.Array,  # [R, max_blocks_per_seq] int32
    query_start_loc: jax.Array,  # [R + 1] int32
    num_seqs: jax.Array,  # [] int32: real sequences; the rest of R is padding
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    tokens_per_chunk: int = DEFAULT_TOKENS_PER_CHUNK,
) -> jax.Array:  # [T, num_q_heads, head_dim]
    """Causal attention of each new token over its sequence's paged context.

    Tokens past ``query_start_loc[num_seqs]`` are padding: their output is zero.
    ``sliding_window`` w lets a query at position p see keys at positions > p - w.
    ``soft_cap`` c maps scores s to c * tanh(s / c) before the softmax.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_padded_seqs, max_blocks = block_tables.shape
    group = num_q_heads // num_kv_heads
    pages_per_chunk = max(1, min(max_blocks, tokens_per_chunk // block_size))
    chunk_len = pages_per_chunk * block_size

    seq, position, is_real = token_positions(num_tokens, kv_lens, query_start_loc, num_seqs)
    padded_blocks = -(-max_blocks // pages_per_chunk) * pages_per_chunk
    tables = jnp.pad(block_tables, ((0, 0), (0, padded_blocks - max_blocks)))[seq]  # [T, padded_blocks]

    is_real_seq = jnp.arange(num_padded_seqs) < num_seqs
    longest = jnp.max(jnp.where(is_real_seq, kv_lens, 0))
    num_chunks = (longest + chunk_len - 1) // chunk_len

    # The dots take the cache's values in their own dtype and accumulate in float32. A cache of
    # 16-bit floats stored as uint16 words (the reference backend's, see kernels/dtype_ops.py) is
    # gathered as words and its pages bitcast back to q's dtype.
    cache_dtype = q.dtype if k_cache.dtype == jnp.uint16 else k_cache.dtype
    q_tkgd = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim) * sm_scale
    q_tkgd = q_tkgd.astype(cache_dtype)

    # [T, chunk, num_kv_heads, head_dim] pages of one chunk, in the values' dtype.
    def read(cache, pages):
        return from_words(cache[pages], cache_dtype).reshape(num_tokens, chunk_len, num_kv_heads, head_dim)

    def chunk(i, carry):
        m_tkg, l_tkg, acc_tkgd = carry
        pages = jax.lax.dynamic_slice_in_dim(tables, i * pages_per_chunk, pages_per_chunk, axis=1)
        k_tskd, v_tskd = read(k_cache, pages), read(v_cache, pages)
        s_tkgs = jnp.einsum("tkgd,tskd->tkgs", q_tkgd, k_tskd, preferred_element_type=jnp.float32)
        if soft_cap is not None:
            s_tkgs = soft_cap * jnp.tanh(s_tkgs / soft_cap)
        kv_pos = i * chunk_len + jnp.arange(chunk_len)
        visible = (kv_pos[None, :] <= position[:, None]) & is_real[:, None]
        if sliding_window is not None:
            visible &= kv_pos[None, :] > position[:, None] - sliding_window
        s_tkgs = jnp.where(visible[:, None, None, :], s_tkgs, -jnp.inf)
        m_new = jnp.maximum(m_tkg, s_tkgs.max(axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a fully masked row stays at zero
        p_tkgs = jnp.exp(s_tkgs - m_safe[..., None])
        alpha = jnp.exp(m_tkg - m_safe)
        l_tkg = alpha * l_tkg + p_tkgs.sum(axis=-1)
        # Masked slots may hold anything (a reused block's stale values, NaN included): p = 0 is not
        # enough, since 0 * NaN = NaN.
        v_tskd = jnp.where(visible[:, :, None, None], v_tskd, jnp.zeros((), cache_dtype))
        pv_tkgd = jnp.einsum(
            "tkgs,tskd->tkgd", p_tkgs.astype(cache_dtype), v_tskd, preferred_element_type=jnp.float32
        )
        acc_tkgd = alpha[..., None] * acc_tkgd + pv_tkgd
        return m_new, l_tkg, acc_tkgd

    init = (
        jnp.full((num_tokens, num_kv_heads, group), -jnp.inf, jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32),
    )
    _, l_tkg, acc_tkgd = jax.lax.fori_loop(0, num_chunks, chunk, init)
    out = acc_tkgd / jnp.where(l_tkg == 0.0, 1.0, l_tkg)[..., None]
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
