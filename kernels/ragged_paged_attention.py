"""Ragged paged attention as one Pallas kernel (Triton lowering on GPU, interpret mode on CPU).

The op is the one of `kernels/reference.py`: a flat batch of new tokens from many sequences (decode
tokens and prefill chunks alike), each attending causally to its sequence's context in the paged
KV cache. One launch serves the whole step, tiled as `kernels/attention_args.py` describes: the grid
is (query blocks, KV heads), a program holds up to `block_q` new tokens of one sequence times the
query heads of one KV head (GQA: the group shares every K/V load), finds its sequence by a binary
search over `query_start_loc`, and loops over the context `block_kv` tokens at a time: page ids
from the block table, K/V rows gathered through them, an online softmax. The loop covers only the
positions the block's queries can see (causal, and the sliding window); padding sequences own no
program that does any work.

Notes for GPU: Pallas on GPU defaults to Mosaic GPU; `plgpu.CompilerParams` selects the Triton
lowering, which has no scalar prefetch, so block tables and lengths are ordinary inputs indexed
in-kernel. Every load past a context is masked to zero, so stale slots (NaN included) never reach
the result. Triton tiles are powers of two: a group of 3 query heads takes 4 rows, one masked.
All loads and stores use index arrays, not slices: they lower to the same Triton pointer math, and
in interpret mode they discharge to gathers and scatters instead of copying the operand.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from xlaserve.kernels.attention_args import next_power_of_2, num_q_blocks, prepare_kernel_call
from xlaserve.kernels.pallas_blocks import (
    locate_query_block,
    mma_precision,
    online_softmax_init,
    online_softmax_step,
)


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
    sliding_window: int | jax.Array | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    interpret: bool = False,
    block_q: int | None = None,
    block_kv: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    num_kv_splits: int | None = None,
    attend_ahead: jax.Array | None = None,
) -> jax.Array:  # [T, num_q_heads, head_dim]
    """Causal attention of each new token over its sequence's paged context (the Pallas kernel).

    Same contract as `kernels.reference.ragged_paged_attention`: tokens past
    ``query_start_loc[num_seqs]`` are padding and get zeros; ``sliding_window`` w (an int, or an
    int32 scalar array: a per-layer window under the layer scan) lets a query at position p see keys
    at positions > p - w; ``soft_cap`` c maps scores s to c * tanh(s / c); ``sinks`` [num_q_heads]
    (gpt-oss) adds exp(sink) of each head to its softmax's denominator; ``attend_ahead`` [T] int32
    lets each token also see that many positions past its own (Gemma 3's image spans).
    Block-table entries a context reaches must be valid block ids (padding entries: the null block).

    Tuning (static; None picks the default): ``block_q`` new tokens per program (a power of two),
    ``block_kv`` context tokens per loop step (a power of two >= 16), and Triton's ``num_warps`` and
    ``num_stages``; ``num_kv_splits`` > 1 splits each query block's context over that many programs
    and merges their partial softmaxes by log-sum-exp (split-KV, for steps with too few query blocks
    to fill the GPU: small-batch decode). ``interpret=True`` runs the kernel on CPU.
    """
    operands, statics = prepare_kernel_call(
        q,
        k_cache,
        v_cache,
        kv_lens,
        block_tables,
        query_start_loc,
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        block_q=block_q,
        block_kv=block_kv,
        num_warps=num_warps,
        num_stages=num_stages,
        num_kv_splits=num_kv_splits,
        sinks=sinks,
    )
    if attend_ahead is not None and attend_ahead.shape != (q.shape[0],):
        raise ValueError(
            f"attend_ahead has shape {attend_ahead.shape}; expected ({q.shape[0]},) (one per token)"
        )
    ahead = jnp.zeros((1,), jnp.int32) if attend_ahead is None else attend_ahead.astype(jnp.int32)
    return _ragged_paged_attention(
        *operands, ahead, **statics, has_ahead=attend_ahead is not None, interpret=interpret
    )


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "has_window", "has_sinks", "has_ahead", "soft_cap", "interpret", "tiling"),
)
def _ragged_paged_attention(
    q,
    k_cache,
    v_cache,
    kv_lens,
    block_tables,
    query_start_loc,
    num_seqs,
    sliding_window,
    sinks,
    attend_ahead,
    *,
    sm_scale,
    has_window,
    has_sinks,
    has_ahead,
    soft_cap,
    interpret,
    tiling,
):
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_padded_seqs = block_tables.shape[0]
    group = num_q_heads // num_kv_heads
    splits = tiling.num_kv_splits

    # A slot's row is block_id * block_size + offset: the cache seen as rows costs no copy.
    k_rows = k_cache.reshape(num_blocks * block_size, num_kv_heads, head_dim)
    v_rows = v_cache.reshape(num_blocks * block_size, num_kv_heads, head_dim)

    kernel = functools.partial(
        _kernel,
        sm_scale=sm_scale,
        has_window=has_window,
        # With split-KV the sinks join when the splits are merged, below: each split's softmax is partial.
        has_sinks=has_sinks and splits == 1,
        has_ahead=has_ahead,
        soft_cap=soft_cap,
        block_q=tiling.block_q,
        block_kv=tiling.block_kv,
        block_size=block_size,
        group=group,
        num_padded_seqs=num_padded_seqs,
        splits=splits,
    )
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    else:  # each split's normalized partial output and its log-sum-exp, merged below
        out_shape = (
            jax.ShapeDtypeStruct((splits, *q.shape), jnp.float32),
            jax.ShapeDtypeStruct((splits, num_tokens, num_q_heads), jnp.float32),
        )
    out = pl.pallas_call(
        kernel,
        grid=(num_q_blocks(num_tokens, num_padded_seqs, tiling.block_q), num_kv_heads, splits),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages),
        name="ragged_paged_attention",
    )(
        num_seqs.reshape(1),
        sliding_window.reshape(1),
        sinks,
        attend_ahead,
        kv_lens,
        query_start_loc,
        block_tables,
        q,
        k_rows,
        v_rows,
    )

    if splits > 1:
        parts, lse = out
        lse_max = jnp.max(lse, axis=0)  # a real token sees itself, so some split's lse is finite
        lse_max = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)
        weights = jnp.exp(lse - lse_max)  # an empty split weighs 0
        total = jnp.sum(weights, axis=0)  # [T, Hq]
        if has_sinks:
            total = total + jnp.exp(sinks[None, :] - lse_max)
        out = (jnp.sum(weights[..., None] * parts, axis=0) / total[..., None]).astype(q.dtype)
    # No program writes the rows of padding tokens: they are undefined until zeroed here.
    is_real = jnp.arange(num_tokens) < query_start_loc[num_seqs]
    return jnp.where(is_real[:, None, None], out, jnp.zeros((), out.dtype))


def _kernel(
    num_seqs_ref,  # [1]
    sliding_window_ref,  # [1]: read only if has_window
    sinks_ref,  # [num_q_heads] float32: read only if has_sinks
    ahead_ref,  # [T] int32: read only if has_ahead
    kv_lens_ref,  # [R]
    query_start_loc_ref,  # [R + 1]
    block_tables_ref,  # [R, max_blocks_per_seq]
    q_ref,  # [T, num_q_heads, head_dim]
    k_ref,  # [num_blocks * block_size, num_kv_heads, head_dim]
    v_ref,  # [num_blocks * block_size, num_kv_heads, head_dim]
    o_ref,  # [T, num_q_heads, head_dim]; with splits: float32 [splits, T, num_q_heads, head_dim]
    *lse_ref,  # with splits: float32 [splits, T, num_q_heads]
    sm_scale: float,
    has_window: bool,
    has_sinks: bool,
    has_ahead: bool,
    soft_cap: float | None,
    block_q: int,
    block_kv: int,
    block_size: int,
    group: int,
    num_padded_seqs: int,
    splits: int,
):
    q_block, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_seqs = num_seqs_ref[0]
    head_dim = q_ref.shape[2]
    padded_group = next_power_of_2(group)
    num_rows = block_q * padded_group

    seq, q_start, q_len, first_local = locate_query_block(
        query_start_loc_ref, num_seqs, q_block, block_q=block_q, num_padded_seqs=num_padded_seqs
    )

    @pl.when((seq < num_seqs) & (first_local < q_len))
    def _():
        kv_len = kv_lens_ref[seq]
        # Row r of the tile is head g = r % padded_group of the group, for the block's token
        # r // padded_group.
        r = jax.lax.broadcasted_iota(jnp.int32, (num_rows, 1), 0)
        local = first_local + r // padded_group  # [rows, 1]: the token's index among the new ones
        g = r % padded_group
        row_is_mine = (local < q_len) & (g < group)  # [rows, 1]
        is_mine = jnp.broadcast_to(row_is_mine, (num_rows, head_dim))
        # Indices, not slices: the same gathers lower for Triton and discharge in interpret mode
        # without copying the operand; a masked row's index may be out of bounds, never written.
        q_index = (
            q_start + local,
            kv_head * group + g,
            jax.lax.broadcasted_iota(jnp.int32, (1, head_dim), 1),
        )
        q = plgpu.load(q_ref.at[q_index], mask=is_mine, other=0)  # [rows, head_dim]
        q_pos = kv_len - q_len + local  # [rows, 1]: absolute positions
        last_pos = jnp.minimum(kv_len - q_len + first_local + block_q, kv_len)  # one past the last query
        upper = q_pos  # the last position each row sees
        if has_ahead:  # a bidirectional span: rows see up to their span's last token
            upper = q_pos + plgpu.load(ahead_ref.at[q_start + local], mask=row_is_mine, other=0)
            last_pos = jnp.minimum(jnp.max(jnp.where(row_is_mine, upper, 0)) + 1, kv_len)
        first_pos = 0
        if has_window:
            sliding_window = sliding_window_ref[0]
            first_pos = jnp.maximum(kv_len - q_len + first_local - sliding_window + 1, 0)
        dims = jax.lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)

        def tile(i, carry):
            kv_pos = i * block_kv + jax.lax.broadcasted_iota(jnp.int32, (block_kv,), 0)
            in_context = kv_pos < kv_len
            pages = plgpu.load(block_tables_ref.at[seq, kv_pos // block_size], mask=in_context, other=0)
            rows = (pages * block_size + kv_pos % block_size)[:, None]  # [block_kv, 1]
            kv_mask = jnp.broadcast_to(in_context[:, None], (block_kv, head_dim))
            if k_ref.dtype.itemsize == 1:
                # A float8 cache (scale 1.0), read as q's dtype: the MMA runs in 16 bits. Triton's
                # lowering cannot fill a masked float8 load, so load whole rows (out-of-context rows
                # point at the null block) and zero them after the convert.
                k = jnp.where(kv_mask, plgpu.load(k_ref.at[rows, kv_head, dims]).astype(q.dtype), 0)
                v = jnp.where(kv_mask, plgpu.load(v_ref.at[rows, kv_head, dims]).astype(q.dtype), 0)
            else:
                k = plgpu.load(k_ref.at[rows, kv_head, dims], mask=kv_mask, other=0)  # [block_kv, head_dim]
                v = plgpu.load(v_ref.at[rows, kv_head, dims], mask=kv_mask, other=0)  # stale slots -> 0
            s = plgpu.dot(q, k, trans_b=True, precision=mma_precision(q.dtype)) * sm_scale  # [rows, block_kv]
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            visible = kv_pos[None, :] <= upper
            if has_window:
                visible &= kv_pos[None, :] > q_pos - sliding_window
            return online_softmax_step(carry, jnp.where(visible, s, -jnp.inf), v)

        init = online_softmax_init(num_rows, head_dim)
        if has_sinks:  # the sink as a first key of value zero: the max starts at its logit, the sum at 1
            sink = plgpu.load(sinks_ref.at[kv_head * group + g], mask=row_is_mine, other=0.0)  # [rows, 1]
            init = (sink, jnp.ones_like(init[1]), init[2])
        first_tile = first_pos // block_kv
        last_tile = (last_pos + block_kv - 1) // block_kv
        if splits > 1:  # this program's share of the tiles; a share may be empty
            per_split = (last_tile - first_tile + splits - 1) // splits
            first_tile = first_tile + split * per_split
            last_tile = jnp.minimum(first_tile + per_split, last_tile)
        m, l, acc = jax.lax.fori_loop(first_tile, last_tile, tile, init)
        out = (acc / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)
        if splits == 1:
            plgpu.store(o_ref.at[q_index], out, mask=is_mine)
        else:
            plgpu.store(o_ref.at[(split, *q_index)], out, mask=is_mine)
            lse = jnp.where(l == 0.0, -jnp.inf, m + jnp.log(jnp.where(l == 0.0, 1.0, l)))  # [rows, 1]
            plgpu.store(lse_ref[0].at[split, q_index[0], q_index[1]], lse, mask=row_is_mine)
