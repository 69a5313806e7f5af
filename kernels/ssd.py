"""Mamba2's state-space layer over a flat ragged batch: the causal depthwise conv and the SSD scan.

The reference path (pure jnp, the spec and the CPU path). Tokens of R sequences are packed in one
flat array, as for attention; `query_start_loc` [R + 1] says where each sequence's new tokens sit,
and tokens past `query_start_loc[R]` are padding. Each sequence enters with its state from earlier
steps (conv: its last K - 1 inputs; SSM: [H, P, N]), zero when its first token is at position 0,
and leaves with the state after its last new token, which the caller writes back to its slot.

The scan is the chunked SSD of Mamba2 (Dao & Gu, 2024): within a chunk of Q tokens the output is a
masked, decayed attention-like product; across chunks a state [H, P, N] carries the rest. Here every
chunk belongs to one sequence (a sequence's tokens are cut every Q tokens from its own start), so a
chunk starts either from its sequence's entering state or from the previous chunk's final state:
at most T // Q + R + 1 chunks of Q slots each. A step in which every sequence has one new token
(decode) takes the recurrent form instead: one state update per token, no chunking.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from xlaserve.kernels.dtype_ops import as_words, from_words, word_dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MambaCache:
    """Every Mamba layer's state per slot (a slot is the request's one block id), donated each step."""

    conv: jax.Array  # [num_layers * num_slots, 1, K - 1, conv_dim]: the last K - 1 conv inputs
    ssm: jax.Array  # [num_layers * num_slots, H, P, N] float32


@dataclasses.dataclass(frozen=True)
class StateCacheSpec:
    """The device arrays of a state-keeping model: one slot per block id (worker/kv_cache.py sizes
    the pool by `bytes_per_block`). Arrays are 4-D like a KV cache so the cache's placement applies."""

    num_layers: int
    conv_kernel: int  # K
    conv_dim: int
    num_heads: int  # H
    head_dim: int  # P
    state_size: int  # N
    cache_class: type = MambaCache
    fixed_num_tokens: int | None = None
    layer_kind = "state"  # the host's bookkeeping kind (worker/kv_cache_groups.py)
    num_kv_heads = 1  # no K/V: the state arrays are split by sharding/rules.py STATE_CACHE_AXES

    @property
    def num_arrays(self) -> int:
        return 2

    def shapes(self, num_blocks: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        rows = self.num_layers * num_blocks
        return (
            (rows, 1, self.conv_kernel - 1, self.conv_dim),
            (rows, self.num_heads, self.head_dim, self.state_size),
        )

    def with_max_num_seqs(self, max_num_seqs: int, num_state_snapshots: int = 0):
        """The spec for an engine running up to `max_num_seqs` requests: the same (its slots, and the
        prefix cache's snapshots, are blocks of the pool sized by the budget alone)."""
        return self

    def copy_state_slots(self, cache: MambaCache, src: jax.Array, dst: jax.Array) -> MambaCache:
        """Every layer's state of slot src[i] written to slot dst[i] (prefix-cache snapshots)."""
        return MambaCache(*(copy_slot_rows(a, self.num_layers, src, dst) for a in (cache.conv, cache.ssm)))

    def fixed_bytes(self, itemsize: int) -> int:
        """Bytes taken from the budget before blocks are counted: none."""
        return 0

    def bytes_per_block(self, block_size: int, itemsize: int) -> int:
        """Bytes of one slot across all layers (whatever the block size: a slot holds any length)."""
        conv, ssm = self.shapes(1)
        return _size(conv) * itemsize + _size(ssm) * 4

    def allocate(self, num_blocks: int, block_size: int, zeros) -> MambaCache:
        """The conv inputs in the cache's dtype; the SSM state in float32 whatever the model's, as a
        hybrid model's (kernels/hybrid_cache.py): rounded to 16 bits where a step ends, a sequence's
        state would change with where its prompt was cut into chunks."""
        conv, ssm = self.shapes(num_blocks)
        return MambaCache(zeros(conv, kind="conv_state"), zeros(ssm, jnp.float32, kind="recurrent_state"))


def copy_slot_rows(array: jax.Array, num_layers: int, src: jax.Array, dst: jax.Array) -> jax.Array:
    """A state array of rows layer * num_slots + slot ([num_layers * num_slots, ...]) with every layer's
    row of slot src[i] copied to slot dst[i]. Pairs (0, 0) pad a fixed-size list: slot 0, the null
    slot, copied onto itself."""
    rows = array.reshape(num_layers, array.shape[0] // num_layers, *array.shape[1:])
    return rows.at[:, dst].set(rows[:, src]).reshape(array.shape)


def _size(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def token_sequences(query_start_loc: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """(sequence of each token [T] in [0, R], R for padding; its index within the step [T])."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    # Empty (padding) sequences are skipped: a token belongs to the last start at or before it.
    seq = jnp.searchsorted(query_start_loc[1:], t, side="right").astype(jnp.int32)
    return seq, t - query_start_loc[seq]


def entering_states(md, rows: jax.Array, *arrays: jax.Array) -> tuple[jax.Array, ...]:
    """Each sequence's rows of the state `arrays` ([rows, ...] each -> [R, ...]) as it enters the step:
    zero for a sequence whose first new token is at position 0 (a new request, or one recomputed
    after preemption: its slot may still hold another request's state). `md`: the step's
    AttentionMetadata."""
    qsl = md.query_start_loc
    is_fresh = (md.kv_lens - (qsl[1:] - qsl[:-1])) == 0  # [R]
    return tuple(jnp.where(is_fresh.reshape(-1, *(1,) * (a.ndim - 1)), 0, a[rows]) for a in arrays)


def ragged_causal_conv1d(
    x: jax.Array,  # [T, Cd]
    weight: jax.Array,  # [Cd, K] (Hugging Face's conv1d weight, squeezed)
    bias: jax.Array | None,  # [Cd]
    conv_state: jax.Array,  # [R, K - 1, Cd]: each sequence's last K - 1 inputs, oldest first
    query_start_loc: jax.Array,  # [R + 1]
) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal conv (before its activation) per sequence, reading the inputs before the
    step from `conv_state`. Returns (out [T, Cd], the new conv_state [R, K - 1, Cd]). A cache that holds
    16-bit floats as raw words (the CPU's: kernels/dtype_ops.py) holds `x`'s inputs as their words:
    read and written by bitcast, never by a numeric conversion."""
    as_stored = conv_state.dtype != x.dtype and conv_state.dtype == word_dtype(x.dtype)
    conv_state = from_words(conv_state, x.dtype)
    num_tokens, _ = x.shape
    num_seqs = query_start_loc.shape[0] - 1
    k = weight.shape[1]
    seq, local = token_sequences(query_start_loc, num_tokens)
    state = jnp.concatenate([conv_state, jnp.zeros_like(conv_state[:1])])  # row R: padding's zeros
    lags = jnp.arange(k, dtype=jnp.int32)  # input t - lag multiplies weight[:, K - 1 - lag]
    back = local[:, None] - lags[None, :]  # [T, K]: the input's index within the step
    from_step = x[jnp.clip(jnp.arange(num_tokens)[:, None] - lags[None, :], 0, num_tokens - 1)]
    from_state = state[seq[:, None], jnp.clip(k - 1 + back, 0, k - 2)]
    window = jnp.where((back >= 0)[..., None], from_step, from_state)  # [T, K, Cd]
    # The taps added in a fixed order (an einsum's order would follow the step's shape): each token's
    # bits depend on its own window alone, which batch invariance needs (kernels/invariant.py).
    taps = weight[:, ::-1].astype(jnp.float32)  # [Cd, K]: tap `lag` multiplies input t - lag
    window = window.astype(jnp.float32)
    out = window[:, 0] * taps[:, 0]
    for lag in range(1, k):
        out = out + window[:, lag] * taps[:, lag]
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    # The new state: the last K - 1 of (old state ++ new inputs).
    num_new = query_start_loc[1:] - query_start_loc[:-1]  # [R]
    src = num_new[:, None] + jnp.arange(k - 1, dtype=jnp.int32)[None, :]  # [R, K - 1] in the join
    from_new = x[jnp.clip(query_start_loc[:-1, None] + src - (k - 1), 0, num_tokens - 1)]
    from_old = conv_state[jnp.arange(num_seqs)[:, None], jnp.clip(src, 0, k - 2)]
    new_state = jnp.where((src >= k - 1)[..., None], from_new, from_old).astype(conv_state.dtype)
    return out.astype(x.dtype), as_words(new_state) if as_stored else new_state


def ragged_ssd(
    x: jax.Array,  # [T, H, P]
    dt: jax.Array,  # [T, H], after softplus and clamping
    a: jax.Array,  # [H], negative (-exp(A_log))
    b: jax.Array,  # [T, G, N]
    c: jax.Array,  # [T, G, N]
    d: jax.Array,  # [H]
    query_start_loc: jax.Array,  # [R + 1]
    initial_states: jax.Array,  # [R, H, P, N] float32
    *,
    chunk_size: int,
    chunk_terms=None,
) -> tuple[jax.Array, jax.Array]:
    """y_t = C_t . h_t + D x_t with h_t = exp(dt_t a) h_{t-1} + dt_t B_t x_t^T, per sequence.
    Returns (y [T, H, P] float32, final states [R, H, P, N] float32). A decode step (at most one
    token per sequence) runs the recurrent form; any other the chunked scan, whose per-chunk part is
    `chunk_terms` (`chunk_terms_reference`, or the Pallas kernel's: kernels/ssd_pallas.py)."""
    chunk_terms = chunk_terms or chunk_terms_reference
    num_new = query_start_loc[1:] - query_start_loc[:-1]
    args = (x, dt, a, b, c, d, query_start_loc, initial_states)
    return jax.lax.cond(
        jnp.max(num_new) <= 1,
        lambda *xs: _recurrent(*xs),
        lambda *xs: _chunked(*xs, chunk_size=chunk_size, chunk_terms=chunk_terms),
        *args,
    )


def _heads(bc: jax.Array, num_heads: int) -> jax.Array:
    """[.., G, N] -> [.., H, N]: head h reads group h // (H / G)."""
    return jnp.repeat(bc, num_heads // bc.shape[-2], axis=-2)


def _recurrent(x, dt, a, b, c, d, query_start_loc, initial_states):
    num_tokens, num_heads, _ = x.shape
    seq, _ = token_sequences(query_start_loc, num_tokens)
    states = jnp.concatenate([initial_states, jnp.zeros_like(initial_states[:1])])
    x32, dt32 = x.astype(jnp.float32), dt.astype(jnp.float32)
    bh, ch = _heads(b, num_heads).astype(jnp.float32), _heads(c, num_heads).astype(jnp.float32)
    decay = jnp.exp(dt32 * a[None, :])  # [T, H]
    h = decay[:, :, None, None] * states[seq] + jnp.einsum("th,thp,thn->thpn", dt32, x32, bh)
    y = jnp.einsum("thpn,thn->thp", h, ch) + d[None, :, None] * x32
    num_new = query_start_loc[1:] - query_start_loc[:-1]
    last = jnp.clip(query_start_loc[:-1], 0, num_tokens - 1)
    final = jnp.where((num_new > 0)[:, None, None, None], h[last], initial_states)
    return y, final


def chunk_terms_reference(
    xdt: jax.Array,  # [C, Q, H, P]: x * dt
    cum: jax.Array,  # [C, Q, H]: cumulative dt * a from the chunk's start
    bh: jax.Array,  # [C, Q, H, N]
    ch: jax.Array,  # [C, Q, H, N]
) -> tuple[jax.Array, jax.Array]:
    """Each chunk on its own (the part the Pallas kernel computes: kernels/ssd_pallas.py):
    (y within the chunk [C, Q, H, P], the chunk's contribution to the state at its end [C, H, P, N]).
    y_q = sum_{s <= q} (C_q . B_s) exp(cum_q - cum_s) dt_s x_s."""
    q = xdt.shape[1]
    causal = jnp.tril(jnp.ones((q, q), bool))[None, :, :, None]
    seg = cum[:, :, None, :] - cum[:, None, :, :]  # [C, Q(q), Q(s), H]
    decay = jnp.where(causal, jnp.exp(jnp.where(causal, seg, -jnp.inf)), 0.0)
    scores = jnp.einsum("cqhn,cshn->cqsh", ch, bh) * decay
    y = jnp.einsum("cqsh,cshp->cqhp", scores, xdt)
    to_end = jnp.exp(cum[:, -1:, :] - cum)  # [C, Q, H]
    return y, jnp.einsum("cqhn,cqh,cqhp->chpn", bh, to_end, xdt)


@dataclasses.dataclass(frozen=True)
class SequenceChunks:
    """A step's tokens cut into chunks of Q, each sequence from its own start, so a chunk belongs to
    one sequence (the padding tokens' chunks to none, sequence R): at most T // Q + R + 1 chunks."""

    chunk: jax.Array  # [T]: each token's chunk
    offset: jax.Array  # [T]: its slot in the chunk
    chunk_seq: jax.Array  # [C]: each chunk's sequence (R: padding or unused)
    is_first: jax.Array  # [C]: the chunk starts its sequence's tokens in this step
    num_chunks: int
    size: int

    @classmethod
    def of(cls, query_start_loc: jax.Array, num_tokens: int, size: int) -> SequenceChunks:
        num_seqs = query_start_loc.shape[0] - 1
        num_chunks = num_tokens // size + num_seqs + 1  # each sequence (and the padding) adds <= 1 partial
        seq, local = token_sequences(query_start_loc, num_tokens)
        chunk = jnp.cumsum((local % size == 0).astype(jnp.int32)) - 1
        return cls(
            chunk=chunk,
            offset=local % size,
            chunk_seq=jnp.full((num_chunks,), num_seqs, jnp.int32).at[chunk].set(seq),
            is_first=jnp.zeros((num_chunks,), bool).at[chunk].max(local < size),
            num_chunks=num_chunks,
            size=size,
        )

    def gather(self, x: jax.Array) -> jax.Array:
        """[T, ...] -> [C, Q, ...]; empty slots zero (for both scans: no decay, no input)."""
        return (
            jnp.zeros((self.num_chunks, self.size, *x.shape[1:]), x.dtype).at[self.chunk, self.offset].set(x)
        )

    def scatter(self, y: jax.Array) -> jax.Array:
        """[C, Q, ...] -> [T, ...]: each token's slot."""
        return y[self.chunk, self.offset]


def _chunked(x, dt, a, b, c, d, query_start_loc, initial_states, *, chunk_size, chunk_terms):
    num_tokens, num_heads, head_dim = x.shape
    chunks = SequenceChunks.of(query_start_loc, num_tokens, chunk_size)
    x32 = chunks.gather(x.astype(jnp.float32))  # [C, Q, H, P]
    dt32 = chunks.gather(dt.astype(jnp.float32))  # [C, Q, H]
    bh = chunks.gather(_heads(b, num_heads).astype(jnp.float32))  # [C, Q, H, N]
    ch = chunks.gather(_heads(c, num_heads).astype(jnp.float32))

    cum = jnp.cumsum(dt32 * a[None, None, :], axis=1)  # [C, Q, H]: log-decay from the chunk's start
    y, local_states = chunk_terms(x32 * dt32[..., None], cum, bh, ch)
    chunk_decay = jnp.exp(cum[:, -1, :])  # [C, H]
    entering = jnp.concatenate([initial_states.astype(jnp.float32), jnp.zeros_like(initial_states[:1])])

    def carry_state(prev, xs):
        first, sq, dec, own = xs
        start = jnp.where(first, entering[sq], prev)
        return dec[:, None, None] * start + own, (start, dec[:, None, None] * start + own)

    _, (starts, ends) = jax.lax.scan(
        carry_state,
        jnp.zeros((num_heads, head_dim, initial_states.shape[-1]), jnp.float32),
        (chunks.is_first, chunks.chunk_seq, chunk_decay, local_states),
    )
    # From the chunk's entering state: y_q += exp(cum_q) C_q . start.
    y = y + jnp.einsum("cqhn,chpn->cqhp", ch, starts) * jnp.exp(cum)[..., None]
    y_tokens = chunks.scatter(y) + d[None, :, None] * x.astype(jnp.float32)
    num_new = query_start_loc[1:] - query_start_loc[:-1]
    last = jnp.clip(query_start_loc[1:] - 1, 0, num_tokens - 1)
    final = jnp.where((num_new > 0)[:, None, None, None], ends[chunks.chunk[last]], initial_states)
    return y_tokens, final
