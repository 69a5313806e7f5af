"""Reductions whose order is fixed by the reduced axis alone: batch-invariant by construction.

XLA's CPU backend picks a reduction's loop order (how it vectorizes, which elements it adds first) from
the whole operand's shape: a row of 576 values sums to different float32 bits in a [1, 576] operand
than in a [16, 576] one (measured, jax 0.10: rows of 576 differ from 8 rows on, of 2048 from 2 on).
So an RMSNorm or a log-softmax over a step's rows rounds a token's values differently depending on how
many other tokens share its step. Here the sum is written as elementwise adds in a fixed tree (halve the
padded width until 16 lanes, then add the lanes in order), which XLA must evaluate as written
(IEEE adds are not reassociated), so each row's bits depend on that row alone.

Cost: one loop fusion; negligible next to the step's matmuls (a [64, 576] norm reduction 1.4x a plain
`jnp.sum`, a [64, 49152] log-softmax's sum ~5x, ~1% of a batch-64 decode step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_LANES = 16  # the tree stops at this width; the lanes are then added one by one


def invariant_sum(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """sum(x, axis) in an order set by x.shape[axis] alone (the module docstring says why)."""
    x = jnp.moveaxis(x, axis, -1)
    n = x.shape[-1]
    width = _LANES
    while width < n:
        width *= 2
    if width != n:  # zeros add exactly
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
    while x.shape[-1] > _LANES:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    total = x[..., 0]
    for lane in range(1, x.shape[-1]):
        total = total + x[..., lane]
    return jnp.expand_dims(total, axis) if keepdims else total


def invariant_mean(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    return invariant_sum(x, axis, keepdims) / x.shape[axis]


def invariant_log_softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    """log_softmax(x) with the invariant sum (max is exact in any order)."""
    shifted = x - jax.lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))
    return shifted - jnp.log(invariant_sum(jnp.exp(shifted), axis, keepdims=True))


def invariant_softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    e = jnp.exp(x - jnp.max(x, axis=axis, keepdims=True))
    return e / invariant_sum(e, axis, keepdims=True)
