"""Multi-head latent attention (DeepSeek) over the paged latent cache as one Pallas kernel.

The op of `kernels/mla.py` (whose docstring explains the weight absorption): every query head
attends to one shared latent "head" ``concat(c, k_pe)`` of ``kv_lora_rank + rope_dim`` numbers per
token, and the value is the latent ``c`` itself. So the kernel is `ragged_paged_attention.py`'s with
one KV head and a group of all query heads, except that a score is two dots (``q_latent . c`` and
``q_rope . k_pe``, each a power of two wide: 512 and 64 for DeepSeek-V2/V3, where their sum is not)
and the value tile is the key tile's first ``kv_lora_rank`` columns (loaded once, used twice).

Tiling: grid (query blocks, head blocks). A program owns up to `block_q` new tokens of one
sequence times `block_h` heads (rows = block_q x block_h, row r is token r // block_h, head
r % block_h of the block) and walks the context `block_kv` tokens at a time: page ids from the
block table, latent rows gathered through them, an online softmax in float32. Sequences are found
by the binary search of `ragged_paged_attention.py`; padding sequences own no working program, and
the wrapper zeroes the rows of padding tokens. Triton lowering on GPU, interpret mode on CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from xlaserve.kernels.attention_args import (
    MIN_DOT_ROWS,
    SUPPORTED_DTYPES,
    check_power_of_2,
    next_power_of_2,
    num_q_blocks,
    program_rows,
    validate_step_metadata,
)
from xlaserve.kernels.mla import check_mla_shapes
from xlaserve.kernels.pallas_blocks import (
    locate_query_block,
    mma_precision,
    online_softmax_init,
    online_softmax_step,
)

DEFAULT_BLOCK_KV = 32  # a [32, 512] bf16 latent tile is 32 KiB of shared memory per stage


@dataclasses.dataclass(frozen=True)
class MLATiling:
    block_q: int  # new tokens per program
    block_h: int  # query heads per program
    block_kv: int  # context tokens per loop step
    num_warps: int
    num_stages: int


def ragged_paged_mla(
    q_latent: jax.Array,  # [T, H, kv_lora_rank]: the absorbed query
    q_rope: jax.Array,  # [T, H, rope_dim]
    latent_cache: jax.Array,  # [num_blocks, block_size, 1, kv_lora_rank + rope_dim]
    kv_lens: jax.Array,  # [R] int32
    block_tables: jax.Array,  # [R, max_blocks_per_seq] int32
    query_start_loc: jax.Array,  # [R + 1] int32
    num_seqs: jax.Array,  # [] int32
    *,
    sm_scale: float,
    interpret: bool = False,
    block_q: int | None = None,
    block_h: int | None = None,
    block_kv: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> jax.Array:  # [T, H, kv_lora_rank]
    """`kernels.mla.mla_paged_attention` as a Pallas kernel: same contract (padding tokens get
    zeros), plus static tiling (None picks the default; powers of two). kv_lora_rank and rope_dim
    must be powers of two >= 16. ``interpret=True`` runs it on CPU."""
    tiling = _validate(
        q_latent,
        q_rope,
        latent_cache,
        kv_lens,
        block_tables,
        query_start_loc,
        num_seqs,
        sm_scale,
        block_q,
        block_h,
        block_kv,
        num_warps,
        num_stages,
    )
    return _ragged_paged_mla(
        q_latent,
        q_rope,
        latent_cache,
        kv_lens,
        block_tables,
        query_start_loc,
        jnp.asarray(num_seqs, jnp.int32),
        sm_scale=float(sm_scale),
        interpret=interpret,
        tiling=tiling,
    )


def _validate(
    q_latent,
    q_rope,
    latent_cache,
    kv_lens,
    block_tables,
    query_start_loc,
    num_seqs,
    sm_scale,
    block_q,
    block_h,
    block_kv,
    num_warps,
    num_stages,
) -> MLATiling:
    for name, q in (("kv_lora_rank", q_latent), ("rope_dim", q_rope)):  # before the cache's shape: its cause
        dim = q.shape[-1] if q.ndim else 0
        if dim < MIN_DOT_ROWS or dim & (dim - 1):
            raise ValueError(f"{name} must be a power of two >= 16 for the MLA kernel, got {dim}")
    num_tokens, num_heads, rank, rope_dim = check_mla_shapes(q_latent, q_rope, latent_cache)
    dtype = jnp.dtype(q_latent.dtype)
    if dtype not in SUPPORTED_DTYPES or {jnp.dtype(q_rope.dtype), jnp.dtype(latent_cache.dtype)} != {dtype}:
        raise ValueError(
            f"q_latent, q_rope and latent_cache must share one of float32, bfloat16, float16; got "
            f"{q_latent.dtype}, {q_rope.dtype}, {latent_cache.dtype}"
        )
    validate_step_metadata(kv_lens, block_tables, query_start_loc, num_seqs, sm_scale=sm_scale)
    num_padded_seqs = block_tables.shape[0]
    rows = program_rows(num_tokens, num_padded_seqs)
    if block_h is None:
        block_h = min(next_power_of_2(num_heads), rows)
    check_power_of_2("block_h", block_h, minimum=1)
    if block_q is None:
        block_q = max(1, rows // block_h)
    tiling = MLATiling(
        block_q,
        block_h,
        DEFAULT_BLOCK_KV if block_kv is None else block_kv,
        4 if num_warps is None else num_warps,
        2 if num_stages is None else num_stages,
    )
    check_power_of_2("block_q", tiling.block_q, minimum=1)
    check_power_of_2("block_kv", tiling.block_kv, minimum=MIN_DOT_ROWS)
    check_power_of_2("num_warps", tiling.num_warps, minimum=1)
    if tiling.block_q * tiling.block_h < MIN_DOT_ROWS:
        raise ValueError(f"block_q * block_h must be >= {MIN_DOT_ROWS} (a dot's rows), got {tiling}")
    return tiling


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret", "tiling"))
def _ragged_paged_mla(
    q_latent,
    q_rope,
    latent_cache,
    kv_lens,
    block_tables,
    query_start_loc,
    num_seqs,
    *,
    sm_scale,
    interpret,
    tiling,
):
    num_tokens, num_heads, _ = q_latent.shape
    num_blocks, block_size, _, latent_dim = latent_cache.shape
    num_padded_seqs = block_tables.shape[0]
    latent_rows = latent_cache.reshape(num_blocks * block_size, latent_dim)  # a slot's row: no copy
    kernel = functools.partial(
        _kernel,
        sm_scale=sm_scale,
        tiling=tiling,
        block_size=block_size,
        num_heads=num_heads,
        num_padded_seqs=num_padded_seqs,
    )
    out = pl.pallas_call(
        kernel,
        grid=(num_q_blocks(num_tokens, num_padded_seqs, tiling.block_q), pl.cdiv(num_heads, tiling.block_h)),
        out_shape=jax.ShapeDtypeStruct(q_latent.shape, q_latent.dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages),
        name="ragged_paged_mla",
    )(num_seqs.reshape(1), kv_lens, query_start_loc, block_tables, q_latent, q_rope, latent_rows)
    is_real = jnp.arange(num_tokens) < query_start_loc[num_seqs]
    return jnp.where(is_real[:, None, None], out, jnp.zeros((), out.dtype))


def _kernel(
    num_seqs_ref,  # [1]
    kv_lens_ref,  # [R]
    query_start_loc_ref,  # [R + 1]
    block_tables_ref,  # [R, max_blocks_per_seq]
    q_latent_ref,  # [T, H, rank]
    q_rope_ref,  # [T, H, rope_dim]
    latent_ref,  # [num_blocks * block_size, rank + rope_dim]
    o_ref,  # [T, H, rank]
    *,
    sm_scale: float,
    tiling: MLATiling,
    block_size: int,
    num_heads: int,
    num_padded_seqs: int,
):
    q_block, head_block = pl.program_id(0), pl.program_id(1)
    block_q, block_h, block_kv = tiling.block_q, tiling.block_h, tiling.block_kv
    num_seqs = num_seqs_ref[0]
    rank, rope_dim = q_latent_ref.shape[2], q_rope_ref.shape[2]
    num_rows = block_q * block_h

    seq, q_start, q_len, first_local = locate_query_block(
        query_start_loc_ref, num_seqs, q_block, block_q=block_q, num_padded_seqs=num_padded_seqs
    )

    @pl.when((seq < num_seqs) & (first_local < q_len))
    def _():
        kv_len = kv_lens_ref[seq]
        r = jax.lax.broadcasted_iota(jnp.int32, (num_rows, 1), 0)
        local = first_local + r // block_h  # [rows, 1]
        head = head_block * block_h + r % block_h
        row_is_mine = (local < q_len) & (head < num_heads)
        rank_dims = jax.lax.broadcasted_iota(jnp.int32, (1, rank), 1)
        rope_dims = jax.lax.broadcasted_iota(jnp.int32, (1, rope_dim), 1)
        token = q_start + local
        q_lat = plgpu.load(
            q_latent_ref.at[token, head, rank_dims],
            mask=jnp.broadcast_to(row_is_mine, (num_rows, rank)),
            other=0,
        )
        q_pe = plgpu.load(
            q_rope_ref.at[token, head, rope_dims],
            mask=jnp.broadcast_to(row_is_mine, (num_rows, rope_dim)),
            other=0,
        )
        q_pos = kv_len - q_len + local
        last_pos = jnp.minimum(kv_len - q_len + first_local + block_q, kv_len)

        def tile(i, carry):
            kv_pos = i * block_kv + jax.lax.broadcasted_iota(jnp.int32, (block_kv,), 0)
            in_context = kv_pos < kv_len
            pages = plgpu.load(block_tables_ref.at[seq, kv_pos // block_size], mask=in_context, other=0)
            rows = (pages * block_size + kv_pos % block_size)[:, None]  # [block_kv, 1]
            c = plgpu.load(
                latent_ref.at[rows, rank_dims],
                mask=jnp.broadcast_to(in_context[:, None], (block_kv, rank)),
                other=0,
            )
            k_pe = plgpu.load(
                latent_ref.at[rows, rank + rope_dims],
                mask=jnp.broadcast_to(in_context[:, None], (block_kv, rope_dim)),
                other=0,
            )
            s = plgpu.dot(q_lat, c, trans_b=True, precision=mma_precision(c.dtype))
            s = (s + plgpu.dot(q_pe, k_pe, trans_b=True, precision=mma_precision(c.dtype))) * sm_scale
            return online_softmax_step(carry, jnp.where(kv_pos[None, :] <= q_pos, s, -jnp.inf), c)

        init = online_softmax_init(num_rows, rank)
        _, l, acc = jax.lax.fori_loop(0, (last_pos + block_kv - 1) // block_kv, tile, init)
        out = (acc / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)
        plgpu.store(
            o_ref.at[token, head, rank_dims], out, mask=jnp.broadcast_to(row_is_mine, (num_rows, rank))
        )
