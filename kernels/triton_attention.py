"""Ragged paged attention as a Triton kernel, launched from JAX through jax-triton (`cuda` extra).

The same op, tiling and grid as the Pallas kernel (`kernels/attention_args.py`), written directly in
Triton: a program owns `block_q` new tokens of one sequence times the query heads of one KV head,
finds its sequence by a binary search over `query_start_loc`, and walks the context `block_kv`
tokens at a time through the block table with an online softmax. Loads past a context are masked
to zero, so stale cache slots never reach the result.

`triton` is needed to import this module (it comes with jax-triton, and with the test extra);
`jax_triton` is imported only when `ragged_paged_attention` is traced, because it refuses to import
without a GPU build of jaxlib. On CPU the kernel runs under Triton's interpreter on torch tensors
(`launch_kernel(interpreted_kernel(), ...)`), which is how its numerics are tested.
"""

# No `from __future__ import annotations`: Triton reads `tl.constexpr` annotations as objects.
import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from xlaserve.kernels.attention_args import Tiling, next_power_of_2, num_q_blocks, prepare_kernel_call


def _attention_kernel(
    num_seqs_ptr,  # [1] int32
    sliding_window_ptr,  # [1] int32: read only if HAS_WINDOW
    sinks_ptr,  # [NUM_Q_HEADS] float32: read only if HAS_SINKS
    kv_lens_ptr,  # [R] int32
    query_start_loc_ptr,  # [R + 1] int32
    block_tables_ptr,  # [R, MAX_BLOCKS] int32
    q_ptr,  # [T, NUM_Q_HEADS, HEAD_DIM]
    k_ptr,  # [num_blocks * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM]
    v_ptr,  # [num_blocks * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM]
    o_ptr,  # [T, NUM_Q_HEADS, HEAD_DIM]
    SM_SCALE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    SOFT_CAP: tl.constexpr,  # 0.0: none
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    PADDED_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MAX_BLOCKS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    NUM_BISECT_STEPS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # under the interpreter: its bfloat16 dot multiplies the raw bits
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    num_seqs = tl.load(num_seqs_ptr)

    # The last real sequence whose first program (qsl[s] // BLOCK_Q + s) is at or before this one.
    lo = 0
    hi = tl.maximum(num_seqs, 1)
    for _ in tl.static_range(NUM_BISECT_STEPS):
        mid = (lo + hi) // 2
        go_right = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    seq = lo
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_local = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q

    if (seq < num_seqs) & (first_local < q_len):
        kv_len = tl.load(kv_lens_ptr + seq)
        # Row r of the tile: head r % PADDED_GROUP of the group, token r // PADDED_GROUP of the block.
        r = tl.arange(0, BLOCK_Q * PADDED_GROUP)
        local = first_local + r // PADDED_GROUP
        g = r % PADDED_GROUP
        is_mine = (local < q_len) & (g < GROUP)
        d = tl.arange(0, HEAD_DIM)
        q_rows = (q_start + local).to(tl.int64) * NUM_Q_HEADS + kv_head * GROUP + g
        q_offsets = q_rows[:, None] * HEAD_DIM + d[None, :]
        q = tl.load(q_ptr + q_offsets, mask=is_mine[:, None], other=0.0)
        q_pos = kv_len - q_len + local
        last_pos = tl.minimum(kv_len - q_len + first_local + BLOCK_Q, kv_len)  # one past the last query
        first_pos = 0
        sliding_window = 0
        if HAS_WINDOW:
            sliding_window = tl.load(sliding_window_ptr)
            first_pos = tl.maximum(kv_len - q_len + first_local - sliding_window + 1, 0)

        m = tl.full([BLOCK_Q * PADDED_GROUP], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_Q * PADDED_GROUP], tl.float32)
        acc = tl.zeros([BLOCK_Q * PADDED_GROUP, HEAD_DIM], tl.float32)
        if HAS_SINKS:  # the sink as a first key of value zero: the max starts at its logit, the sum at 1
            m = tl.load(sinks_ptr + kv_head * GROUP + g, mask=is_mine, other=0.0)
            l = tl.full([BLOCK_Q * PADDED_GROUP], 1.0, tl.float32)
        for i in range(first_pos // BLOCK_KV, (last_pos + BLOCK_KV - 1) // BLOCK_KV):
            kv_pos = i * BLOCK_KV + tl.arange(0, BLOCK_KV)
            in_context = kv_pos < kv_len
            pages = tl.load(
                block_tables_ptr + seq * MAX_BLOCKS + kv_pos // BLOCK_SIZE, mask=in_context, other=0
            )
            kv_rows = pages.to(tl.int64) * BLOCK_SIZE + kv_pos % BLOCK_SIZE
            kv_offsets = (kv_rows * NUM_KV_HEADS + kv_head)[:, None] * HEAD_DIM + d[None, :]
            # A float8 cache (scale 1.0) is read as q's dtype: the MMA runs in 16 bits.
            k = tl.load(k_ptr + kv_offsets, mask=in_context[:, None], other=0.0).to(q.dtype)
            v = tl.load(v_ptr + kv_offsets, mask=in_context[:, None], other=0.0).to(q.dtype)
            if UPCAST_DOT:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            s = s * SM_SCALE
            if SOFT_CAP > 0:
                # c * tanh(s / c), tanh through exp (no libdevice, so the interpreter runs it too).
                e = tl.exp(-2.0 * tl.abs(s / SOFT_CAP))
                s = tl.where(s < 0, -SOFT_CAP, SOFT_CAP) * (1.0 - e) / (1.0 + e)
            visible = kv_pos[None, :] <= q_pos[:, None]
            if HAS_WINDOW:
                visible = visible & (kv_pos[None, :] > q_pos[:, None] - sliding_window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet stays 0
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m - m_safe)
            l = alpha * l + tl.sum(p, axis=1)
            p_v = p.to(v.dtype)  # rounded like the MMA's operand, also when upcast
            if UPCAST_DOT:
                acc = alpha[:, None] * acc + tl.dot(
                    p_v.to(tl.float32), v.to(tl.float32), input_precision="ieee"
                )
            else:
                acc = alpha[:, None] * acc + tl.dot(p_v, v, input_precision=DOT_PRECISION)
            m = m_new
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(o_ptr + q_offsets, out.to(o_ptr.dtype.element_ty), mask=is_mine[:, None])


compiled_kernel = triton.jit(_attention_kernel)


@functools.cache
def interpreted_kernel():
    """The kernel under Triton's interpreter (CPU, numpy), whatever TRITON_INTERPRET said at import."""
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(_attention_kernel)


def kernel_params(
    q_shape,
    cache_shape,
    block_tables_shape,
    dtype,
    *,
    sm_scale,
    has_window,
    soft_cap,
    tiling: Tiling,
    has_sinks: bool = False,
    interpreted: bool = False,
) -> tuple[tuple[int, int], dict]:
    """-> (grid, constexpr parameters) of one launch."""
    num_tokens, num_q_heads, head_dim = q_shape
    _, block_size, num_kv_heads, _ = cache_shape
    num_padded_seqs, max_blocks = block_tables_shape
    group = num_q_heads // num_kv_heads
    grid = (num_q_blocks(num_tokens, num_padded_seqs, tiling.block_q), num_kv_heads)
    params = {
        "SM_SCALE": float(sm_scale),
        "HAS_WINDOW": bool(has_window),
        "HAS_SINKS": bool(has_sinks),
        "SOFT_CAP": float(soft_cap or 0.0),
        "NUM_Q_HEADS": num_q_heads,
        "NUM_KV_HEADS": num_kv_heads,
        "GROUP": group,
        "PADDED_GROUP": next_power_of_2(group),
        "HEAD_DIM": head_dim,
        "BLOCK_SIZE": block_size,
        "MAX_BLOCKS": max_blocks,
        "BLOCK_Q": tiling.block_q,
        "BLOCK_KV": tiling.block_kv,
        "NUM_BISECT_STEPS": max(1, num_padded_seqs.bit_length()),
        # float32 inputs: exact products (no TF32), like the reference; 16-bit inputs: the native MMA.
        "DOT_PRECISION": "ieee" if jnp.dtype(dtype) == jnp.float32 else "tf32",
        # Under the interpreter a bfloat16 tl.dot multiplies the raw uint16 bits (Triton 3.9); float32
        # products of the bfloat16 operands are exact, so the upcast keeps the GPU's numerics.
        "UPCAST_DOT": interpreted and jnp.dtype(dtype) != jnp.float32,
    }
    return grid, params


def launch_kernel(
    kernel,
    q,
    k_cache,
    v_cache,
    kv_lens,
    block_tables,
    query_start_loc,
    num_seqs,
    out,
    *,
    sm_scale,
    sliding_window=None,
    soft_cap=None,
    sinks=None,
    tiling: Tiling,
    dtype,
) -> None:
    """Launch `kernel` on tensors Triton takes directly (torch on GPU, or torch on CPU under the
    interpreter), writing `out` [T, Hq, D]. `num_seqs` and `sliding_window` (when not None) are [1]
    int32 tensors, `sinks` (when not None) a [Hq] float32 one; `dtype` is q's dtype as a JAX dtype.
    Rows of padding tokens are left as they were (the JAX wrapper zeroes them)."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    grid, params = kernel_params(
        tuple(q.shape),
        tuple(k_cache.shape),
        tuple(block_tables.shape),
        dtype,
        sm_scale=sm_scale,
        has_window=sliding_window is not None,
        soft_cap=soft_cap,
        tiling=tiling,
        has_sinks=sinks is not None,
        interpreted=not isinstance(kernel, triton.runtime.JITFunction),
    )
    k_rows = k_cache.reshape(num_blocks * block_size, num_kv_heads, head_dim)
    v_rows = v_cache.reshape(num_blocks * block_size, num_kv_heads, head_dim)
    kernel[grid](
        num_seqs,
        num_seqs if sliding_window is None else sliding_window,
        q if sinks is None else sinks,  # any tensor where there are none: never read
        kv_lens,
        query_start_loc,
        block_tables,
        q,
        k_rows,
        v_rows,
        out,
        num_warps=tiling.num_warps,
        num_stages=tiling.num_stages,
        **params,
    )


def ragged_paged_attention(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    k_cache: jax.Array,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: jax.Array,  # [num_blocks, block_size, num_kv_heads, head_dim]
    kv_lens: jax.Array,  # [R] int32
    block_tables: jax.Array,  # [R, max_blocks_per_seq] int32
    query_start_loc: jax.Array,  # [R + 1] int32
    num_seqs: jax.Array,  # [] int32
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
) -> jax.Array:  # [T, num_q_heads, head_dim]
    """The Triton kernel through `jax_triton.triton_call` (GPU only); the contract of
    `kernels.reference.ragged_paged_attention`, the tuning knobs of the Pallas kernel."""
    if interpret:
        raise ValueError(
            "the jax-triton kernel has no interpret mode; on CPU run its Triton kernel under Triton's "
            "interpreter (launch_kernel(interpreted_kernel(), ...)) or use the 'pallas' backend"
        )
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
        sinks=sinks,
    )
    return _ragged_paged_attention(*operands, **statics)


@functools.partial(jax.jit, static_argnames=("sm_scale", "has_window", "has_sinks", "soft_cap", "tiling"))
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
    *,
    sm_scale,
    has_window,
    has_sinks,
    soft_cap,
    tiling,
):
    import jax_triton  # only importable with a GPU build of jaxlib

    num_tokens = q.shape[0]
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    grid, params = kernel_params(
        q.shape,
        k_cache.shape,
        block_tables.shape,
        q.dtype,
        sm_scale=sm_scale,
        has_window=has_window,
        soft_cap=soft_cap,
        tiling=tiling,
        has_sinks=has_sinks,
    )
    out = jax_triton.triton_call(
        num_seqs.reshape(1),
        sliding_window.reshape(1),
        sinks,
        kv_lens,
        query_start_loc,
        block_tables,
        q,
        k_cache.reshape(num_blocks * block_size, num_kv_heads, head_dim),
        v_cache.reshape(num_blocks * block_size, num_kv_heads, head_dim),
        kernel=compiled_kernel,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=grid,
        num_warps=tiling.num_warps,
        num_stages=tiling.num_stages,
        name="ragged_paged_attention_triton",
        **params,
    )
    # No program writes the rows of padding tokens: they are undefined until zeroed here.
    is_real = jnp.arange(num_tokens) < query_start_loc[num_seqs]
    return jnp.where(is_real[:, None, None], out, jnp.zeros((), out.dtype))
