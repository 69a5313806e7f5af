"""Online-softmax attention over page chunks of one layer's paged cache: the reference attention's
(kernels/reference.py) decode, few, short and long paths, and the per-device attention of context
parallelism (sharding/context_parallel.py).

A `PagedAttend` holds one layer's cache and its per-layer settings (sliding window, soft cap, sinks, a
rank's slot stride); each method serves one shape of query set, reading a few pages a loop step and
folding them into a running (max, sum, accumulator). On CPU with a 16-bit or float32 cache the
per-query paths call the C++ op instead (kernels/cpu_ops.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from xlaserve.kernels import cpu_ops
from xlaserve.kernels.dtype_ops import from_words, is_8bit_float, is_16bit_float


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
