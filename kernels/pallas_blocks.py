"""What the Pallas attention programs share, inside a kernel: which sequence a query block serves,
one online-softmax step over a context tile, and the dot precision by dtype.

Both kernels (`ragged_paged_attention.py`, `ragged_paged_mla.py`) tile the flat ragged batch as
`attention_args.py` describes: sequence s owns programs `[qsl[s] // block_q + s, qsl[s + 1] //
block_q + s + 1)` along the token axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu


def locate_query_block(query_start_loc_ref, num_seqs, q_block, *, block_q: int, num_padded_seqs: int):
    """-> (seq, q_start, q_len, first_local): the sequence whose programs include `q_block` (a binary
    search over `query_start_loc`), where its new tokens start and how many there are, and this
    block's first token among them. Past the real tokens, first_local >= q_len or seq >= num_seqs."""

    def first_program(s):
        return query_start_loc_ref[s] // block_q + s

    def bisect(_, lo_hi):
        lo, hi = lo_hi  # invariant: first_program(lo) <= q_block, and the answer is < hi
        mid = (lo + hi) // 2
        go_right = first_program(mid) <= q_block
        return jnp.where(go_right, mid, lo), jnp.where(go_right, hi, mid)

    num_steps = max(1, num_padded_seqs.bit_length())
    seq, _ = jax.lax.fori_loop(0, num_steps, bisect, (jnp.int32(0), jnp.maximum(num_seqs, 1)))
    q_start = query_start_loc_ref[seq]
    q_len = query_start_loc_ref[seq + 1] - q_start
    return seq, q_start, q_len, (q_block - first_program(seq)) * block_q


def online_softmax_init(num_rows: int, dim: int):
    """The running (max, sum, accumulator) of `num_rows` rows before any tile: -inf, 0, 0."""
    return (
        jnp.full((num_rows, 1), -jnp.inf, jnp.float32),
        jnp.zeros((num_rows, 1), jnp.float32),
        jnp.zeros((num_rows, dim), jnp.float32),
    )


def online_softmax_step(carry, s, v):
    """Fold one tile into the running (max, sum, accumulator) of each row: `s` [rows, tile] scores
    (-inf where not visible), `v` [tile, dim] values. A row that has seen nothing yet stays 0."""
    m, l, acc = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_safe)
    alpha = jnp.exp(m - m_safe)
    l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    acc = alpha * acc + plgpu.dot(p.astype(v.dtype), v, precision=mma_precision(v.dtype))
    return m_new, l, acc


def mma_precision(dtype):
    """float32 inputs: exact products (no TF32), like the reference; 16-bit inputs: the native MMA."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT
