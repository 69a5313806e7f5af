"""The gated delta rule (Gated DeltaNet: Qwen3.5, Qwen3-Next) over a flat ragged batch.

The reference path (pure jnp, the spec and the CPU path). Per value head, a state S [Dk, Dv] is
decayed and corrected token by token (Yang et al., 2024):

    S_t = exp(g_t) S_{t-1};  S_t += beta_t k_t (v_t - k_t^T S_t)^T;  o_t = S_t^T q_t

with q and k L2-normalized and q scaled by Dk^-0.5. Tokens of R sequences are packed as for attention
(`query_start_loc` [R + 1]; tokens past its end are padding); each sequence enters with its state from
earlier steps (zero at position 0) and leaves with the state after its last new token.

A step of prefills runs the chunked form: each sequence cut every Q tokens from its own start (as in
kernels/ssd.py), a chunk's Q delta updates condensed into matmuls by the UT transform (a unit lower
triangular solve), and a scan over chunks carrying S. A decode step (at most one token per sequence)
runs the recurrence itself.

With batch invariance on (kernels/invariant.py, the default), both give way to the recurrence run
token by token: iteration j advances every sequence by its j-th new token, with elementwise ops and
fixed-order sums only, so a token's bits depend on its own sequence alone: not on its companions,
the step's bucket, or where its prompt was cut into chunks. It costs a loop of as many iterations as
the step's longest sequence has new tokens (one for a decode step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from xlaserve.kernels.invariant import enabled as invariance_enabled
from xlaserve.kernels.invariant import invariant_sum
from xlaserve.kernels.ssd import SequenceChunks, token_sequences

L2NORM_EPS = 1e-6  # Hugging Face's and the FLA library's


def l2_normalize(x: jax.Array) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis, in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(invariant_sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def ragged_gated_delta_rule(
    q: jax.Array,  # [T, Hk, Dk]
    k: jax.Array,  # [T, Hk, Dk]
    v: jax.Array,  # [T, Hv, Dv]; value head h reads key head h // (Hv / Hk)
    g: jax.Array,  # [T, Hv]: the log of each token's decay (<= 0)
    beta: jax.Array,  # [T, Hv]: each token's write strength, in (0, 1)
    query_start_loc: jax.Array,  # [R + 1]
    initial_states: jax.Array,  # [R, Hv, Dk, Dv] float32
    *,
    chunk_size: int,
    chunk_terms=None,
) -> tuple[jax.Array, jax.Array]:
    """Returns (o [T, Hv, Dv] float32, final states [R, Hv, Dk, Dv] float32). q and k are normalized
    here (Hugging Face's use_qk_l2norm_in_kernel). `chunk_terms`: the chunked form's per-chunk part,
    `chunk_terms_reference` (None) or the Pallas kernel's (kernels/gated_delta_pallas.py)."""
    num_heads = v.shape[1]
    q = jnp.repeat(l2_normalize(q), num_heads // q.shape[1], axis=1) * (q.shape[-1] ** -0.5)
    k = jnp.repeat(l2_normalize(k), num_heads // k.shape[1], axis=1)
    args = (q, k, v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32))
    if invariance_enabled():
        return _token_by_token(*args, query_start_loc, initial_states.astype(jnp.float32))
    num_new = query_start_loc[1:] - query_start_loc[:-1]
    return jax.lax.cond(
        jnp.max(num_new) <= 1,
        lambda *xs: _recurrent(*xs),
        lambda *xs: _chunked(*xs, chunk_size=chunk_size, chunk_terms=chunk_terms or chunk_terms_reference),
        *args,
        query_start_loc,
        initial_states.astype(jnp.float32),
    )


def _token_by_token(q, k, v, g, beta, query_start_loc, initial_states):
    """The recurrence, one token of every sequence per iteration, in an order fixed per token."""
    num_tokens = q.shape[0]
    starts = query_start_loc[:-1]
    num_new = query_start_loc[1:] - starts  # [R]

    def advance(j, carry):
        s, o = carry  # [R, H, Dk, Dv], [T, H, Dv]
        is_live = j < num_new
        t = jnp.clip(starts + j, 0, num_tokens - 1)
        qt, kt, vt, gt, bt = q[t], k[t], v[t], g[t], beta[t]
        s_new = s * jnp.exp(gt)[:, :, None, None]
        delta = (vt - invariant_sum(s_new * kt[..., None], axis=2)) * bt[..., None]
        s_new = s_new + kt[..., None] * delta[:, :, None, :]
        ot = invariant_sum(s_new * qt[..., None], axis=2)
        s = jnp.where(is_live[:, None, None, None], s_new, s)
        return s, o.at[jnp.where(is_live, starts + j, num_tokens)].set(ot, mode="drop")

    o = jnp.zeros(v.shape, jnp.float32)
    final, o = jax.lax.fori_loop(0, jnp.max(num_new), advance, (initial_states, o))
    return o, final


def _recurrent(q, k, v, g, beta, query_start_loc, initial_states):
    """One token per sequence: the recurrence itself."""
    num_tokens = q.shape[0]
    seq, _ = token_sequences(query_start_loc, num_tokens)
    states = jnp.concatenate([initial_states, jnp.zeros_like(initial_states[:1])])  # row R: padding's
    s = states[seq] * jnp.exp(g)[:, :, None, None]  # [T, H, Dk, Dv]
    delta = (v - jnp.einsum("thkv,thk->thv", s, k)) * beta[..., None]
    s = s + k[..., None] * delta[:, :, None, :]
    o = jnp.einsum("thkv,thk->thv", s, q)
    num_new = query_start_loc[1:] - query_start_loc[:-1]
    first = jnp.clip(query_start_loc[:-1], 0, num_tokens - 1)
    final = jnp.where((num_new > 0)[:, None, None, None], s[first], initial_states)
    return o, final


def chunk_terms_reference(q, k, v, g, beta):
    """Each chunk on its own, [C, Q, H, ...] in: the parts of the chunk's output and state update that
    do not depend on the state it enters with. Returns, per chunk and head ([C, H, ...]):
    u = T (beta v) and w = T (beta exp(cum) k), where T = (I + strictly_lower(beta k k^T * decay))^-1
    (the UT transform: the chunk's delta updates applied at once, T by forward substitution); the
    intra-chunk scores (q k^T * decay, causal); q and k decayed to the chunk's start and end; the
    chunk's total decay."""
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # [C, H, Q, D]
    cum = jnp.cumsum(jnp.swapaxes(g, 1, 2), axis=-1)  # [C, H, Q]: log-decay from the chunk's start
    beta = jnp.swapaxes(beta, 1, 2)[..., None]  # [C, H, Q, 1]
    size = q.shape[2]
    causal = jnp.tril(jnp.ones((size, size), bool))
    decay = jnp.where(
        causal, jnp.exp(jnp.where(causal, cum[..., :, None] - cum[..., None, :], -jnp.inf)), 0.0
    )
    k_beta = k * beta
    inverse = _unit_lower_inverse(
        jnp.where(jnp.tril(causal, -1), (k_beta @ jnp.swapaxes(k, -1, -2)) * decay, 0.0)
    )
    u = inverse @ (v * beta)
    w = inverse @ (k_beta * jnp.exp(cum)[..., None])
    scores = (q @ jnp.swapaxes(k, -1, -2)) * decay
    q_in = q * jnp.exp(cum)[..., None]  # reads the entering state
    k_out = k * jnp.exp(cum[..., -1:] - cum)[..., None]  # writes the leaving state
    return u, w, scores, q_in, k_out, jnp.exp(cum[..., -1])


def _unit_lower_inverse(lower: jax.Array) -> jax.Array:
    """(I + lower)^-1 for strictly lower triangular `lower` [.., Q, Q], by forward substitution: row i
    of -(I + L)^-1 + I is -L_i - sum_j L_ij (row j), rows j < i final when row i is computed (Hugging
    Face's export path; `jax.scipy.linalg.solve_triangular` in XLA's CPU runtime did not return within
    two minutes at Qwen3.5's shapes: 6 chunks x 16 heads of 64 x 64, jax 0.10.2)."""
    size = lower.shape[-1]

    def row(i, acc):
        r = acc[..., i, :]  # [.., Q]: entries j < i only
        return acc.at[..., i, :].set(r + jnp.einsum("...j,...jc->...c", r, acc))

    acc = jax.lax.fori_loop(1, size, row, -lower)
    return acc + jnp.eye(size, dtype=lower.dtype)


def _chunked(q, k, v, g, beta, query_start_loc, initial_states, *, chunk_size, chunk_terms):
    num_tokens = v.shape[0]
    chunks = SequenceChunks.of(query_start_loc, num_tokens, chunk_size)
    u, w, scores, q_in, k_out, chunk_decay = chunk_terms(*(chunks.gather(x) for x in (q, k, v, g, beta)))
    entering = jnp.concatenate([initial_states, jnp.zeros_like(initial_states[:1])])

    def step(prev, xs):
        first, sq, u, w, scores, q_in, k_out, decay = xs
        s = jnp.where(first, entering[sq], prev)  # [H, Dk, Dv]
        v_new = u - w @ s  # [H, Q, Dv]: what the state does not already predict
        o = q_in @ s + scores @ v_new
        s = s * decay[:, None, None] + jnp.swapaxes(k_out, -1, -2) @ v_new
        return s, (o, s)

    _, (o, ends) = jax.lax.scan(
        step,
        jnp.zeros(initial_states.shape[1:], jnp.float32),
        (chunks.is_first, chunks.chunk_seq, u, w, scores, q_in, k_out, chunk_decay),
    )
    o_tokens = chunks.scatter(jnp.swapaxes(o, 1, 2))  # [T, H, Dv]
    num_new = query_start_loc[1:] - query_start_loc[:-1]
    last = jnp.clip(query_start_loc[1:] - 1, 0, num_tokens - 1)
    final = jnp.where((num_new > 0)[:, None, None, None], ends[chunks.chunk[last]], initial_states)
    return o_tokens, final
