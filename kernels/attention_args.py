"""What the ragged paged attention kernels share: argument validation, tile sizes, and the grid.

Both kernels (Pallas in `ragged_paged_attention.py`, Triton in `triton_attention.py`) tile the flat
ragged batch the same way: a program owns up to `block_q` new tokens of one sequence times the
query heads of one KV head, padded to a power of two (`block_q * padded_group` rows), and walks the
context `block_kv` tokens at a time. Sequence s owns the programs
`[qsl[s] // block_q + s, qsl[s + 1] // block_q + s + 1)` (found in-kernel by a binary search, as in
vLLM's Triton kernel), so `(T - 1) // block_q + min(R, T)` programs cover any mix of decode tokens and
prefill chunks; the programs left over, and padding sequences, do nothing.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from xlaserve.kernels import invariant

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MIN_DOT_ROWS = 16  # Triton's tl.dot needs at least 16 rows and columns
DEFAULT_BLOCK_KV = 64
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 2


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def program_rows(num_tokens: int, num_padded_seqs: int) -> int:
    """Query rows (tokens x heads) per attention program: 16 for decode-sized steps (T <= R), 64
    otherwise. With batch invariance on (kernels/invariant.py), 64 for every step: a tile's shape picks
    the tensor-core instruction (and so how a row's dot is summed), and a token decoded must get the
    bits it gets inside a prefill chunk. Decode is bound by reading the KV cache, not by the idle rows."""
    if invariant.enabled():
        return 64
    return MIN_DOT_ROWS if num_tokens <= num_padded_seqs else 64


def num_q_blocks(num_tokens: int, num_padded_seqs: int, block_q: int) -> int:
    """Programs along the token axis: enough for any split of T tokens into <= R sequences."""
    return (num_tokens - 1) // block_q + min(num_padded_seqs, num_tokens)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static tile sizes of one compiled kernel (all powers of two)."""

    block_q: int  # new tokens per program
    block_kv: int  # context tokens per loop step
    num_warps: int
    num_stages: int
    num_kv_splits: int = 1  # Pallas only: programs sharing one query block's context (split-KV)

    @staticmethod
    def resolve(
        num_tokens: int,
        num_padded_seqs: int,
        group: int,
        *,
        block_q: int | None = None,
        block_kv: int | None = None,
        num_warps: int | None = None,
        num_stages: int | None = None,
        num_kv_splits: int | None = None,
    ) -> Tiling:
        """Fill in defaults: 16 rows per program for decode-sized steps (T <= R: mostly one token per
        sequence), 64 when prefill chunks may be present; 64 context tokens per loop step; no split.
        With batch invariance on, 64 rows always (`program_rows`)."""
        if block_q is None:
            block_q = max(1, program_rows(num_tokens, num_padded_seqs) // next_power_of_2(group))
        tiling = Tiling(
            block_q,
            DEFAULT_BLOCK_KV if block_kv is None else block_kv,
            DEFAULT_NUM_WARPS if num_warps is None else num_warps,
            DEFAULT_NUM_STAGES if num_stages is None else num_stages,
            1 if num_kv_splits is None else num_kv_splits,
        )
        check_power_of_2("block_q", tiling.block_q, minimum=1)
        check_power_of_2("block_kv", tiling.block_kv, minimum=MIN_DOT_ROWS)
        check_power_of_2("num_warps", tiling.num_warps, minimum=1)
        if not isinstance(tiling.num_stages, int) or tiling.num_stages < 1:
            raise ValueError(f"num_stages must be an int >= 1, got {tiling.num_stages!r}")
        if not isinstance(tiling.num_kv_splits, int) or not 1 <= tiling.num_kv_splits <= 64:
            raise ValueError(f"num_kv_splits must be an int in [1, 64], got {tiling.num_kv_splits!r}")
        return tiling


FP8_CACHE_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def _cache_dtype_ok(cache_dtype, q_dtype) -> bool:
    """The cache holds q's dtype, or float8 (`--kv-cache-dtype fp8`, scale 1.0: read as q's dtype)."""
    return jnp.dtype(cache_dtype) in (jnp.dtype(q_dtype), *FP8_CACHE_DTYPES)


def check_power_of_2(name: str, value, *, minimum: int) -> None:
    if not isinstance(value, int) or value < minimum or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value!r}")


def validate_step_metadata(kv_lens, block_tables, query_start_loc, num_seqs, *, sm_scale) -> None:
    """Check the step's metadata (int32, shapes agreeing on R) and the softmax scale; errors name them."""
    if len(block_tables.shape) != 2:
        raise ValueError(
            f"block_tables must be [R, max_blocks_per_seq], got shape {tuple(block_tables.shape)}"
        )
    num_padded_seqs = block_tables.shape[0]
    for name, x, shape in (
        ("kv_lens", kv_lens, (num_padded_seqs,)),
        ("block_tables", block_tables, tuple(block_tables.shape)),
        ("query_start_loc", query_start_loc, (num_padded_seqs + 1,)),
        ("num_seqs", num_seqs, ()),
    ):
        if tuple(jnp.shape(x)) != shape:
            raise ValueError(
                f"{name} must have shape {shape} (R={num_padded_seqs}), got {tuple(jnp.shape(x))}"
            )
        if jnp.result_type(x) != jnp.int32:
            raise ValueError(f"{name} must be int32, got {jnp.result_type(x)}")
    if not isinstance(sm_scale, (int, float)) or not sm_scale > 0:
        raise ValueError(f"sm_scale must be a float > 0, got {sm_scale!r}")


def validate_attention_args(
    q,
    k_cache,
    v_cache,
    kv_lens,
    block_tables,
    query_start_loc,
    num_seqs,
    *,
    sm_scale,
    sliding_window,
    soft_cap,
    sinks=None,
) -> None:
    """Check the shapes, dtypes and static values of a ragged paged attention call; errors name them."""
    if len(q.shape) != 3 or q.shape[0] < 1:
        raise ValueError(f"q must be [num_tokens >= 1, num_q_heads, head_dim], got shape {tuple(q.shape)}")
    if len(k_cache.shape) != 4:
        raise ValueError(
            "k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got shape "
            f"{tuple(k_cache.shape)}"
        )
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} differs from k_cache shape {tuple(k_cache.shape)}"
        )
    if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"q dtype must be one of float32, bfloat16, float16, got {q.dtype}")
    if not all(_cache_dtype_ok(c.dtype, q.dtype) for c in (k_cache, v_cache)):
        raise ValueError(
            f"k_cache/v_cache dtypes ({k_cache.dtype}, {v_cache.dtype}) must equal the q dtype {q.dtype}"
        )
    _, num_q_heads, head_dim = q.shape
    _, _, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"k_cache head_dim {cache_head_dim} differs from the q head_dim {head_dim}")
    if head_dim < MIN_DOT_ROWS or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16 for the attention kernels, got {head_dim}")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    validate_step_metadata(kv_lens, block_tables, query_start_loc, num_seqs, sm_scale=sm_scale)
    if isinstance(sliding_window, int) and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    is_array = sliding_window is not None and not isinstance(sliding_window, int)  # per-layer, traced
    if is_array and (
        jnp.shape(sliding_window) != () or not jnp.issubdtype(jnp.result_type(sliding_window), jnp.integer)
    ):
        raise ValueError(
            "sliding_window must be None, an int >= 1 or an integer scalar array, got "
            f"shape {jnp.shape(sliding_window)} dtype {jnp.result_type(sliding_window)}"
        )
    if soft_cap is not None and (not isinstance(soft_cap, (int, float)) or not soft_cap > 0):
        raise ValueError(f"soft_cap must be None or a float > 0, got {soft_cap!r}")
    check_sinks(sinks, num_q_heads)


def check_sinks(sinks, num_q_heads: int) -> None:
    """Attention sinks (gpt-oss): None, or one logit per query head, a float array [num_q_heads]."""
    if sinks is None:
        return
    if tuple(jnp.shape(sinks)) != (num_q_heads,) or not jnp.issubdtype(jnp.result_type(sinks), jnp.floating):
        raise ValueError(
            f"sinks must be None or a float array [num_q_heads={num_q_heads}], got shape "
            f"{tuple(jnp.shape(sinks))} dtype {jnp.result_type(sinks)}"
        )


def prepare_kernel_call(
    q,
    k_cache,
    v_cache,
    kv_lens,
    block_tables,
    query_start_loc,
    num_seqs,
    *,
    sm_scale,
    sliding_window,
    soft_cap,
    block_q,
    block_kv,
    num_warps,
    num_stages,
    num_kv_splits=None,
    sinks=None,
) -> tuple[tuple, dict]:
    """The prologue both kernels share: validate, pick the tiling, and split the call into the
    dynamic operands and the static keywords of the private kernel body."""
    validate_attention_args(
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
        sinks=sinks,
    )
    num_tokens, num_q_heads, _ = q.shape
    tiling = Tiling.resolve(
        num_tokens,
        block_tables.shape[0],
        num_q_heads // k_cache.shape[2],
        block_q=block_q,
        block_kv=block_kv,
        num_warps=num_warps,
        num_stages=num_stages,
        num_kv_splits=num_kv_splits,
    )
    operands = (
        q,
        k_cache,
        v_cache,
        kv_lens,
        block_tables,
        query_start_loc,
        jnp.asarray(num_seqs, jnp.int32),
        jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32),
        # One logit per query head that every query's softmax counts in its denominator (a key whose
        # value is zero); zeros and unread when there are none.
        jnp.zeros((num_q_heads,), jnp.float32) if sinks is None else jnp.asarray(sinks, jnp.float32),
    )
    statics = {
        "sm_scale": float(sm_scale),
        "has_window": sliding_window is not None,
        "has_sinks": sinks is not None,
        "soft_cap": None if soft_cap is None else float(soft_cap),
        "tiling": tiling,
    }
    return operands, statics
