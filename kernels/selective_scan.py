"""Mamba's selective scan (Mamba1: Jamba's recurrent layers) over a flat ragged batch.

Per channel d of a sequence's state h [D, N] (N the state size):

    h_t = exp(dt_t[d] * A[d]) * h_{t-1} + dt_t[d] * B_t * x_t[d]
    y_t[d] = C_t . h_t + D[d] * x_t[d]

with dt_t already through its bias and softplus. Unlike Mamba2's SSD (kernels/ssd.py), A is a matrix
[D, N], not a scalar per head, so there is no chunked matmul form to exploit; the scan runs one token
of every sequence per iteration (a `fori_loop` over the longest sequence's new tokens, vectorized over
sequences and channels), each token's sums in a fixed order (`invariant_sum`): a token's bits depend
on its own sequence alone (batch invariant), and decode is the same loop run once. The contract is
the SSD scan's: the step's sequences by `query_start_loc`, each entering with its state (zero for a
sequence at position 0, kernels/ssd.entering_states) and leaving with its final one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from xlaserve.kernels.invariant import invariant_sum


def ragged_selective_scan(
    x: jax.Array,  # [T, D]
    dt: jax.Array,  # [T, D] float32, after bias and softplus
    a: jax.Array,  # [D, N] float32 (negative)
    b: jax.Array,  # [T, N]
    c: jax.Array,  # [T, N]
    d: jax.Array,  # [D] float32
    query_start_loc: jax.Array,  # [R + 1] int32
    initial_states: jax.Array,  # [R, D, N] float32
) -> tuple[jax.Array, jax.Array]:  # y [T, D] float32 (padding rows zero), final states [R, D, N]
    """The scan of every sequence over its new tokens (see the module docstring)."""
    num_tokens, channels = x.shape
    if a.shape[0] != channels or b.shape != c.shape or b.shape[0] != num_tokens:
        raise ValueError(
            f"selective scan: x {x.shape}, A {a.shape}, B {b.shape} and C {c.shape} disagree "
            "(expected x [T, D], A [D, N], B and C [T, N])"
        )
    x, b, c = (v.astype(jnp.float32) for v in (x, b, c))
    starts = query_start_loc[:-1]
    num_new = query_start_loc[1:] - starts  # [R]

    def advance(j, carry):
        h, y = carry  # [R, D, N], [T, D]
        is_live = j < num_new
        t = jnp.clip(starts + j, 0, num_tokens - 1)
        dt_t = dt[t][..., None]  # [R, D, 1]
        h_new = jnp.exp(dt_t * a) * h + dt_t * b[t][:, None, :] * x[t][..., None]
        y_t = invariant_sum(h_new * c[t][:, None, :], axis=-1) + d * x[t]  # [R, D]
        h = jnp.where(is_live[:, None, None], h_new, h)
        return h, y.at[jnp.where(is_live, starts + j, num_tokens)].set(y_t, mode="drop")

    y = jnp.zeros((num_tokens, channels), jnp.float32)
    final, y = jax.lax.fori_loop(0, jnp.max(num_new), advance, (initial_states.astype(jnp.float32), y))
    return y, final
