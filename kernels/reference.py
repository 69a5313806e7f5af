"""Reference paged attention over the flat ragged batch, in pure jnp: the spec and the CPU path.

One step holds T new tokens from R sequences laid end to end (``query_start_loc``). The new tokens
of a sequence are the last positions of its context (``kv_lens``), so a prefill chunk and a decode
token are the same thing to this op: queries at known positions, attending causally to the cache.

Memory stays bounded: every path walks the block tables a few pages at a time with an online
softmax, and its trip count is set by the contexts it actually serves (a dynamic bound), so short
batches never touch the padded tail of the block tables. Each sequence takes one of four paths, and
a path no sequence takes is skipped whole (a `lax.cond`: its setup alone cost more than the decode
path's work at batch 64):

- decode (one new token): one query per sequence, gathering that sequence's pages ([R] wide);
- few (2 to ``few_queries`` new tokens: a speculative verification, a tiny prompt): the sequence's
  pages gathered once for all its queries ([R, F] wide);
- short (more tokens over a short context): every token gathers its own pages ([T] wide), cheap
  while the context is short;
- long (the rest, e.g. a prefill chunk deep into a long prompt): tiles of ``tile_queries``
  consecutive queries of one sequence share each gathered page chunk, so the scores are real
  matmuls and the pages are read once per tile instead of once per token. Gathering per token
  made an 8,000-token prefill on CPU read ~T x context keys per layer and step.

On CPU with a bfloat16 cache (stored as uint16 words) or a float32 one, the decode, few and short
paths call one C++ op instead (`kernels/cpu_ops.py`: every key row read once from its page, in
float32); the jnp paths stay the specification and serve everywhere else (a float16 or float8
cache, other platforms, no compiler).

Batch invariance (kernels/invariant.py, on by default): the long path is not taken, so with the C++ op
every query of every step is the op's one per-query reduction (its keys in position order, one softmax
over them), whatever the step's split: a prompt chunked or not, a token decoded or teacher-forced,
computes the same bits. The long path's tiles round differently (an online softmax over 512-key chunks);
per query the op costs about as much (measured 1.0-1.5x the tiles for 512-2048 queries over 2-4K keys,
SmolLM2's heads: kernels/KERNELS.md). Without the op (a float8 or float16 cache, bidirectional image
spans) the short path serves those queries instead: its chunks of keys sit at fixed positions, and a
float8 cache's tiles (float32 queries and probabilities) had moved a 300-token prompt's logprobs by 1e-2
from its decoded tokens' (the short path's bfloat16 ones).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from xlaserve.kernels import invariant
from xlaserve.kernels.dtype_ops import as_words, is_8bit_float, is_16bit_float
from xlaserve.kernels.paged_attend import PagedAttend

DEFAULT_TOKENS_PER_CHUNK = 64  # KV tokens per loop step of the decode and short paths
DEFAULT_TILE_QUERIES = 64  # queries per tile of the long path
DEFAULT_TILE_KV_TOKENS = 512  # KV tokens per loop step of the long path
# A multi-token sequence whose context is at most this long takes the short path; past it, gathering
# its pages for each of the step's T tokens costs more than a tile's wasted rows.
DEFAULT_SHORT_CONTEXT = 256
# A sequence with 2..this many new tokens (a speculative verification: its last token and k drafts; a
# tiny prompt) takes the few path: its pages are gathered once for all its queries.
DEFAULT_FEW_QUERIES = 8


def write_kv(
    k_cache: jax.Array,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: jax.Array,  # [num_blocks, block_size, num_kv_heads, head_dim]
    k: jax.Array,  # [T, num_kv_heads, head_dim]
    v: jax.Array,  # [T, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # [T] int32: block_id * block_size + offset
    *,
    kv_dtype=None,
    positions: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Scatter this step's keys and values into their cache slots (padding goes to the null block).
    `positions` [T] (the tokens' positions) is not read here: a decode-context-parallel cache
    (sharding/context_parallel.py) writes each token on the rank its position names.
    A float8 cache (`kv_dtype`: the float8 its uint8 words hold; default float8_e4m3fn) stores them
    with scale 1.0, saturated at the format's largest value (as vLLM's fp8 cache with no scales)."""
    block_size = k_cache.shape[1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size

    def write(cache, new):
        if cache.dtype == jnp.uint16:  # a cache of 16-bit floats stored as words (dtype_ops.py)
            if not is_16bit_float(new.dtype):
                raise TypeError(f"a cache of 16-bit words takes 16-bit float keys/values, got {new.dtype}")
            return cache.at[blocks, offsets].set(as_words(new))
        if cache.dtype == jnp.uint8 or is_8bit_float(cache.dtype):  # --kv-cache-dtype fp8 (words on CPU)
            fp8 = kv_dtype or (cache.dtype if is_8bit_float(cache.dtype) else FP8_E4M3)
            new = to_fp8(new, fp8)
            return cache.at[blocks, offsets].set(as_words(new) if cache.dtype == jnp.uint8 else new)
        return cache.at[blocks, offsets].set(new.astype(cache.dtype))

    return write(k_cache, k), write(v_cache, v)


FP8_E4M3 = jnp.dtype(jnp.float8_e4m3fn)


def to_fp8(x: jax.Array, dtype) -> jax.Array:
    """x in float8 `dtype` with scale 1.0, saturated (a plain cast would give NaN past the range)."""
    limit = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32), -limit, limit).astype(dtype)


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
    sliding_window: int | jax.Array | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    tokens_per_chunk: int = DEFAULT_TOKENS_PER_CHUNK,
    tile_queries: int = DEFAULT_TILE_QUERIES,
    tile_kv_tokens: int = DEFAULT_TILE_KV_TOKENS,
    short_context: int = DEFAULT_SHORT_CONTEXT,
    few_queries: int = DEFAULT_FEW_QUERIES,
    kv_dtype=None,
    attend_ahead: jax.Array | None = None,
) -> jax.Array:  # [T, num_q_heads, head_dim]
    """Causal attention of each new token over its sequence's paged context.

    Tokens past ``query_start_loc[num_seqs]`` are padding: their output is zero.
    ``sliding_window`` w lets a query at position p see keys at positions > p - w.
    ``soft_cap`` c maps scores s to c * tanh(s / c) before the softmax.
    ``sinks`` [num_q_heads] (gpt-oss): each head's softmax counts exp(sink) in its denominator, as if
    a key of value zero were always visible (a query may then attend to "nothing").
    The other keywords only choose how the work is split (see the module docstring).
    ``kv_dtype``: the float8 dtype a uint8 cache's words hold (`--kv-cache-dtype fp8`; default e4m3).
    ``attend_ahead`` [T] int32: how many positions past its own a token also sees (Gemma 3's image
    tokens see their whole image: bidirectional spans, each computed within one step); the sliding
    window still counts back from the token's own position. Given, the C++ op is not used.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_padded_seqs, max_blocks = block_tables.shape
    group = num_q_heads // num_kv_heads
    pages_per_chunk = max(1, min(max_blocks, tokens_per_chunk // block_size))
    pages_per_tile_chunk = max(1, min(max_blocks, tile_kv_tokens // block_size))
    padded_blocks = _round_up(max_blocks, math.lcm(pages_per_chunk, pages_per_tile_chunk))
    tables = jnp.pad(block_tables, ((0, 0), (0, padded_blocks - max_blocks)))  # [R, padded_blocks]
    # A cache of 16-bit floats stored as uint16 words (the reference backend's: kernels/dtype_ops.py)
    # is gathered as words and only the gathered pages are seen as q's dtype again.
    value_dtype = q.dtype if k_cache.dtype == jnp.uint16 else k_cache.dtype
    if k_cache.dtype == jnp.uint8:  # a float8 cache stored as words: pages seen as float8, then widened
        value_dtype = jnp.dtype(kv_dtype or FP8_E4M3)
    sinks_kg = None if sinks is None else sinks.astype(jnp.float32).reshape(num_kv_heads, group)
    attend = PagedAttend(k_cache, v_cache, sliding_window, soft_cap, value_dtype, sinks_kg)

    seq, position, is_real = token_positions(num_tokens, kv_lens, query_start_loc, num_seqs)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    is_real_seq = jnp.arange(num_padded_seqs) < num_seqs
    is_decode = is_real_seq & (q_lens == 1)
    few_queries = min(few_queries, num_tokens)
    is_few = is_real_seq & (q_lens > 1) & (q_lens <= few_queries)
    # Batch-invariant: no long path (the module docstring says why), with the C++ op or without it.
    with_long_path = not invariant.enabled()
    is_long = is_real_seq & (q_lens > few_queries) & (kv_lens > short_context) & with_long_path
    is_short = is_real_seq & (q_lens > few_queries) & ~is_long

    q_tkgd = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim) * sm_scale

    # Each path runs under a cond on whether any sequence takes it: a path's setup (its folded queries,
    # its accumulators, its scatter) costs even with a zero-trip loop, ~60% of a batch-64 decode step's
    # attention for the two paths a decode step does not take.
    def short(out_tkgd):  # every token of a short sequence gathers its own pages ([T] wide)
        active = is_real & is_short[seq]
        upper = None if attend_ahead is None else position + attend_ahead
        out = attend.per_query(q_tkgd, tables[seq], position, active, pages_per_chunk, upper)
        return jnp.where(active[:, None, None, None], out, out_tkgd)

    def decode(out_tkgd):  # the one token of each decoding sequence ([R] wide)
        last = jnp.maximum(query_start_loc[1:] - 1, 0)
        # With attend_ahead (0 for a decode token), the same jnp path as the other rows: a token's bits
        # do not depend on whether its step's chunk was one token long.
        upper = None if attend_ahead is None else kv_lens - 1 + attend_ahead[last]
        out_rkgd = attend.per_query(q_tkgd[last], tables, kv_lens - 1, is_decode, pages_per_chunk, upper)
        return out_tkgd.at[jnp.where(is_decode, last, num_tokens)].set(out_rkgd, mode="drop")

    def few(out_tkgd):  # up to few_queries consecutive tokens of each such sequence ([R, F] wide)
        j = jnp.arange(few_queries)
        rows = query_start_loc[:-1, None] + j  # [R, F]
        active_rf = is_few[:, None] & (j < q_lens[:, None])
        position_rf = kv_lens[:, None] - q_lens[:, None] + j
        q_rfkgd = q_tkgd[jnp.minimum(rows, num_tokens - 1)]
        upper_rf = (
            None if attend_ahead is None else position_rf + attend_ahead[jnp.minimum(rows, num_tokens - 1)]
        )
        out_rfkgd = attend.per_sequence(q_rfkgd, tables, position_rf, active_rf, pages_per_chunk, upper_rf)
        return out_tkgd.at[jnp.where(active_rf, rows, num_tokens)].set(out_rfkgd, mode="drop")

    def long(out_tkgd):  # tiles of one sequence's consecutive queries
        return attend.tiles(
            q_tkgd,
            out_tkgd,
            tables,
            kv_lens,
            query_start_loc,
            is_long,
            tile_queries,
            pages_per_tile_chunk,
            attend_ahead,
        )

    out_tkgd = jnp.zeros_like(q_tkgd)
    paths = [(is_short, short), (is_decode, decode)] + ([(is_long, long)] if with_long_path else [])
    if few_queries > 1:
        paths.append((is_few, few))
    for takes, path in paths:
        out_tkgd = jax.lax.cond(takes.any(), path, lambda out: out, out_tkgd)
    return out_tkgd.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
