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

Batch invariance (kernels/invariant.py, on by default): with the C++ op there, the long path is not
taken either, so every query of every step is the op's one per-query reduction (its keys in position
order, one softmax over them), whatever the step's split: a prompt chunked or not, a token decoded or
teacher-forced, computes the same bits. The long path's tiles round differently (an online softmax over
512-key chunks); per query the op costs about as much (measured 1.0-1.5x the tiles for 512-2048 queries
over 2-4K keys, SmolLM2's heads: kernels/KERNELS.md).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from xlaserve.kernels import cpu_ops, invariant
from xlaserve.kernels.dtype_ops import as_words, from_words, is_8bit_float, is_16bit_float

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
    # Batch-invariant with the C++ op: one op for every query, no long path (the module docstring says why).
    with_long_path = not (invariant.enabled() and cpu_ops.usable(k_cache, value_dtype))
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


class PagedAttend:
    """Online-softmax attention over page chunks of one layer's cache, for a set of queries (also the
    per-device attention of context parallelism: sharding/context_parallel.py)."""

    def __init__(
        self, k_cache, v_cache, sliding_window, soft_cap, value_dtype, sinks_kg=None, kv_stride=1, kv_offset=0
    ):
        self.k_cache, self.v_cache = k_cache, v_cache
        self.value_dtype = value_dtype
        self.block_size = k_cache.shape[1]
        self.sliding_window, self.soft_cap = sliding_window, soft_cap
        self.sinks_kg = sinks_kg  # [kv_heads, group] float32, or None
        # The sequence position of a table's slot j is j * kv_stride + kv_offset: a decode-context-parallel
        # rank holds every kv_stride-th token from kv_offset (sharding/context_parallel.py); queries'
        # positions are the sequence's.
        self.kv_stride, self.kv_offset = kv_stride, kv_offset

    def kv_positions(self, chunk: jax.Array, chunk_len: int) -> jax.Array:
        """The sequence positions of loop step `chunk`'s chunk_len slots."""
        slots = chunk * chunk_len + jnp.arange(chunk_len)
        return slots if self.kv_stride == 1 else slots * self.kv_stride + self.kv_offset

    def init(self, shape, head_dim, sink_rows=None):
        """The running (max, sum, accumulator) of rows `shape` before any key: -inf, 0, 0; with sinks,
        each row's sink logit and exp(0) = 1, the sink being a first key of value zero.
        `sink_rows(sinks_kg)` lays the [kv_heads, group] sinks out as the rows (default: trailing)."""
        m, l, acc = _init(shape, head_dim)
        if self.sinks_kg is None:
            return m, l, acc
        sinks = self.sinks_kg if sink_rows is None else sink_rows(self.sinks_kg)
        return jnp.broadcast_to(sinks, shape), jnp.ones(shape, jnp.float32), acc

    def chunk_range(self, first_position, last_position, chunk_len):
        """Loop bounds over chunks of chunk_len keys covering what queries at positions in
        [first_position, last_position] may see."""

        def slot(position):  # the last slot at or before `position` (-1 when none)
            return position if self.kv_stride == 1 else (position - self.kv_offset) // self.kv_stride

        start = 0
        if self.sliding_window is not None:
            start = jnp.maximum(slot(first_position - self.sliding_window + 1), 0) // chunk_len
        return start, (slot(last_position) + chunk_len) // chunk_len

    def update(self, carry, s, mask, contract):
        """One chunk of the online softmax: scores `s` (masked where `mask` is False, last axis the
        keys) fold into carry (max, sum, acc); `contract(p)` is the probabilities times the values,
        which must be zeros wherever they may be stale (slots past a context can hold NaN, and
        0 * NaN = NaN)."""
        m, l, acc = carry
        if self.soft_cap is not None:
            s = self.soft_cap * jnp.tanh(s / self.soft_cap)
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a fully masked row stays at zero
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        l = alpha * l + p.sum(axis=-1)
        return m_new, l, alpha[..., None] * acc + contract(p)

    def visible(self, kv_pos, position, upper=None):
        """Keys a query at `position` sees: up to its own position (or to `upper`, a bidirectional
        span's end), and within the sliding window back from its position."""
        visible = kv_pos <= (position if upper is None else upper)
        if self.sliding_window is not None:
            visible &= kv_pos > position - self.sliding_window
        return visible

    def gather(self, pages):
        """Pages [..., P] -> keys and values [..., P * block_size, kv_heads, head_dim]."""
        shape = (*pages.shape[:-1], pages.shape[-1] * self.block_size, *self.k_cache.shape[2:])
        # Each page gathered as one flat row: XLA's CPU gather copies a [block_size * kv_heads * head_dim]
        # slice per index ~4x faster than the same bytes as a [block_size, kv_heads, head_dim] slice
        # (the reshape of the cache is free: a row-major bitcast).
        num_blocks = self.k_cache.shape[0]
        k = self.k_cache.reshape(num_blocks, -1)[pages]
        v = self.v_cache.reshape(num_blocks, -1)[pages]
        return from_words(k, self.value_dtype).reshape(shape), from_words(v, self.value_dtype).reshape(shape)

    def per_query(self, q_nkgd, tables_np, position_n, active_n, pages_per_chunk, upper_n=None):
        """Each of N queries over its own table's pages: -> [N, k, g, d] (inactive rows zero)."""
        upper_nf = None if upper_n is None else upper_n[:, None]
        out = self.per_sequence(
            q_nkgd[:, None], tables_np, position_n[:, None], active_n[:, None], pages_per_chunk, upper_nf
        )
        return out[:, 0]

    def per_sequence(self, q_nfkgd, tables_np, position_nf, active_nf, pages_per_chunk, upper_nf=None):
        """F queries of each of N sequences over that sequence's pages, gathered once for all F:
        -> [N, F, k, g, d] (inactive queries zero). `upper_nf`: see `visible`."""
        n, f, num_kv_heads, group, head_dim = q_nfkgd.shape
        # One C++ op reads the pages in place (causal only).
        if upper_nf is None and cpu_ops.usable(self.k_cache, self.value_dtype):
            out = cpu_ops.paged_attention(
                q_nfkgd.reshape(n * f, num_kv_heads, group, head_dim),
                self.k_cache,
                self.v_cache,
                jnp.repeat(tables_np, f, axis=0),
                position_nf.reshape(-1),
                active_nf.reshape(-1),
                self.sliding_window,
                self.soft_cap,
                self.sinks_kg,
            )
            return out.reshape(n, f, num_kv_heads, group, head_dim)
        if is_16bit_float(self.value_dtype) or is_8bit_float(self.value_dtype):
            start, stop = self._loop_bounds(
                position_nf, active_nf, pages_per_chunk * self.block_size, upper_nf
            )
            return self._folded(
                q_nfkgd, tables_np, position_nf, active_nf, pages_per_chunk, start, stop, upper_nf
            )
        return _normalize(
            self.partials(q_nfkgd, tables_np, position_nf, active_nf, pages_per_chunk, upper_nf)
        )

    def _loop_bounds(self, position_nf, active_nf, chunk_len, upper_nf=None):
        first = jnp.min(jnp.where(active_nf, position_nf, jnp.iinfo(jnp.int32).max))
        last = jnp.max(jnp.where(active_nf, position_nf if upper_nf is None else upper_nf, -1))
        return self.chunk_range(first, last, chunk_len)

    def partials(self, q_nfkgd, tables_np, position_nf, active_nf, pages_per_chunk, upper_nf=None):
        """`per_sequence`'s float32 loop, stopped before the softmax is normalized: the running (max
        [N, F, k, g], sum [N, F, k, g], weighted values [N, F, k, g, d]), which a caller holding other
        keys elsewhere merges by log-sum-exp (decode context parallel). `tables_np` padded to a multiple
        of pages_per_chunk pages."""
        n, f, num_kv_heads, group, head_dim = q_nfkgd.shape
        chunk_len = pages_per_chunk * self.block_size
        start, stop = self._loop_bounds(position_nf, active_nf, chunk_len, upper_nf)
        upper = None if upper_nf is None else upper_nf[..., None]

        def chunk(i, carry):
            pages = jax.lax.dynamic_slice_in_dim(tables_np, i * pages_per_chunk, pages_per_chunk, axis=1)
            k, v = self.gather(pages)
            kv_pos = self.kv_positions(i, chunk_len)
            visible = self.visible(kv_pos, position_nf[..., None], upper) & active_nf[..., None]  # [n, f, s]
            s = jnp.einsum("nfkgd,nskd->nfkgs", q_nfkgd, k.astype(jnp.float32))
            v = jnp.where(visible.any(axis=1)[:, :, None, None], v.astype(jnp.float32), 0.0)
            mask = visible[:, :, None, None, :]
            return self.update(carry, s, mask, lambda p: jnp.einsum("nfkgs,nskd->nfkgd", p, v))

        return jax.lax.fori_loop(start, stop, chunk, self.init((n, f, num_kv_heads, group), head_dim))

    def _folded(
        self, q_nfkgd, tables_np, position_nf, active_nf, pages_per_chunk, start, stop, upper_nf=None
    ):
        """`per_sequence` for a 16- or 8-bit cache, with the KV heads folded into one dot per sequence.

        Contracting "nfkgd,nskd" needs (n, k) as batch dims, so XLA transposes every gathered chunk
        to [n, k, s, d], a strided copy fused with the gather that cost most of a decode step's
        attention on CPU. Here the queries are block-diagonal over KV heads, [n, (f k g), (k' d)] with
        zeros where k != k', so each chunk's keys and values are contracted as gathered, [n, s, (k d)],
        in 16-bit with float32 accumulation (native on CPUs with AVX512-BF16); the k' != k blocks of the
        output are dropped at the end. It does num_kv_heads times the (negligible) flops. A float8
        cache's pages are widened to bfloat16 (exact) and contracted the same way.
        """
        n, f, num_kv_heads, group, head_dim = q_nfkgd.shape
        rows, width = f * num_kv_heads * group, num_kv_heads * head_dim
        chunk_len = pages_per_chunk * self.block_size
        dtype = jnp.bfloat16 if is_8bit_float(self.value_dtype) else self.value_dtype
        eye = jnp.eye(num_kv_heads, dtype=jnp.float32)
        q_nhc = (q_nfkgd[..., None, :] * eye[:, None, :, None]).reshape(n, rows, width).astype(dtype)
        upper = None if upper_nf is None else upper_nf[..., None]

        def chunk(i, carry):
            pages = jax.lax.dynamic_slice_in_dim(tables_np, i * pages_per_chunk, pages_per_chunk, axis=1)
            k, v = (x.reshape(n, chunk_len, width).astype(dtype) for x in self.gather(pages))  # [n, s, (k d)]
            kv_pos = self.kv_positions(i, chunk_len)
            visible = self.visible(kv_pos, position_nf[..., None], upper) & active_nf[..., None]  # [n, f, s]
            s = jnp.einsum("nhc,nsc->nhs", q_nhc, k, preferred_element_type=jnp.float32)
            v = jnp.where(visible.any(axis=1)[:, :, None], v, jnp.zeros((), dtype))
            mask = jnp.broadcast_to(visible[:, :, None, :], (n, f, num_kv_heads * group, chunk_len))
            return self.update(
                carry,
                s,
                mask.reshape(n, rows, chunk_len),
                lambda p: jnp.einsum("nhs,nsc->nhc", p.astype(dtype), v, preferred_element_type=jnp.float32),
            )

        init = self.init((n, rows), width, lambda s_kg: jnp.broadcast_to(s_kg, (f, *s_kg.shape)).reshape(-1))
        m, l, acc = jax.lax.fori_loop(start, stop, chunk, init)
        acc_nfkgjd = acc.reshape(n, f, num_kv_heads, group, num_kv_heads, head_dim)
        acc_nfkgd = jnp.einsum("nfkgjd,kj->nfkgd", acc_nfkgjd, eye)  # keep the k' = k blocks
        return _normalize((m, l.reshape(n, f, num_kv_heads, group), acc_nfkgd))

    def tiles(
        self,
        q_tkgd,
        out_tkgd,
        tables,
        kv_lens,
        query_start_loc,
        is_long,
        tile_queries,
        pages_per_chunk,
        attend_ahead=None,
    ):
        """The queries of `is_long` sequences, tile_queries at a time: -> out_tkgd with their rows set."""
        num_tokens, num_kv_heads, group, head_dim = q_tkgd.shape
        chunk_len = pages_per_chunk * self.block_size
        q_lens = query_start_loc[1:] - query_start_loc[:-1]
        tiles_per_seq = jnp.where(is_long, -(-q_lens // tile_queries), 0)
        tile_ends = jnp.cumsum(tiles_per_seq)
        # Slack rows after the last token, so a tile's fixed-size slice never runs off the end.
        pad = ((0, tile_queries), (0, 0), (0, 0), (0, 0))
        q_pad, out_pad = jnp.pad(q_tkgd, pad), jnp.pad(out_tkgd, pad)
        ahead_pad = None if attend_ahead is None else jnp.pad(attend_ahead, (0, tile_queries))
        rows = jnp.arange(tile_queries)

        def tile(i, out_pad):
            r = jnp.searchsorted(tile_ends, i, side="right")
            q_start = query_start_loc[r] + (i - (tile_ends[r] - tiles_per_seq[r])) * tile_queries
            num_rows = jnp.minimum(tile_queries, query_start_loc[r + 1] - q_start)
            position = kv_lens[r] - query_start_loc[r + 1] + q_start + rows  # [q]
            is_row = rows < num_rows
            upper = None
            if ahead_pad is not None:
                upper = position + jax.lax.dynamic_slice_in_dim(ahead_pad, q_start, tile_queries)
            # [k, (g q), d]: one plain batched matmul per KV head (measured ~30% faster on CPU than
            # contracting the [q, k, g, d] tile directly, which makes XLA transpose inside the loop).
            q_qkgd = jax.lax.dynamic_slice_in_dim(q_pad, q_start, tile_queries)
            q_kmd = q_qkgd.transpose(1, 2, 0, 3).reshape(num_kv_heads, group * tile_queries, head_dim)
            last = position[num_rows - 1] if upper is None else jnp.max(jnp.where(is_row, upper, -1))
            start, stop = self.chunk_range(position[0], last, chunk_len)

            def chunk(j, carry):
                pages = jax.lax.dynamic_slice_in_dim(tables[r], j * pages_per_chunk, pages_per_chunk)
                k, v = (x.astype(jnp.float32).transpose(1, 0, 2) for x in self.gather(pages))  # [k, s, d]
                kv_pos = self.kv_positions(j, chunk_len)
                row_upper = None if upper is None else upper[:, None]
                visible = (
                    self.visible(kv_pos[None, :], position[:, None], row_upper) & is_row[:, None]
                )  # [q, s]
                mask = jnp.broadcast_to(visible, (group, tile_queries, chunk_len)).reshape(1, -1, chunk_len)
                v = jnp.where((kv_pos < kv_lens[r])[None, :, None], v, 0.0)
                s = jnp.einsum("kmd,ksd->kms", q_kmd, k)
                return self.update(carry, s, mask, lambda p: jnp.einsum("kms,ksd->kmd", p, v))

            init = self.init(
                (num_kv_heads, group * tile_queries),
                head_dim,
                lambda s_kg: jnp.repeat(s_kg, tile_queries, axis=1),  # rows (g, q) of each KV head
            )
            out_kmd = _normalize(jax.lax.fori_loop(start, stop, chunk, init))
            out_qkgd = out_kmd.reshape(num_kv_heads, group, tile_queries, head_dim).transpose(2, 0, 1, 3)
            old = jax.lax.dynamic_slice_in_dim(out_pad, q_start, tile_queries)
            new = jnp.where(is_row[:, None, None, None], out_qkgd, old)
            return jax.lax.dynamic_update_slice_in_dim(out_pad, new, q_start, axis=0)

        return jax.lax.fori_loop(0, tile_ends[-1], tile, out_pad)[:num_tokens]


def _init(shape, head_dim):
    return (
        jnp.full(shape, -jnp.inf, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros((*shape, head_dim), jnp.float32),
    )


def _normalize(carry):
    _, l, acc = carry
    return acc / jnp.where(l == 0.0, 1.0, l)[..., None]
