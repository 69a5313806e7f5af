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

The switch (`--batch-invariant`, on by default; `XLASERVE_BATCH_INVARIANT=0` turns it off) is read when
a program is traced, not passed to every layer: the engine traces its programs inside
`batch_invariance(config.model.batch_invariant)` (`traced_with`), and these functions, the reference
attention's path choice (kernels/reference.py) and the MLA reference read `enabled()`. Off, they are
XLA's own reductions and the attention's fastest split: the same values to rounding, but a token's bits
may change with its companions. Float32 dots (kernels/dtype_ops.py: padded and tiled by rows) are
covered only when asked too (`--batch-invariant-float32`, `covers_float32()`): their one-row product is
a fast native matrix-vector dot, and padding it costs a batch-1 step ~1.5x on CPU, over issue 29's 5%.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp

# A context variable, not a global: two engines in one process (a test's float32 and bfloat16 ones, a
# drafter beside its target) each trace under their own setting. Outside any engine: on.
_ENABLED = contextvars.ContextVar("xlaserve_batch_invariant", default=True)
_FLOAT32 = contextvars.ContextVar("xlaserve_batch_invariant_float32", default=False)


def enabled() -> bool:
    """Whether the program being traced must be batch-invariant."""
    return _ENABLED.get()


def covers_float32() -> bool:
    """Whether its float32 dots must be too (padded and tiled: kernels/dtype_ops.py), at their cost."""
    return _ENABLED.get() and _FLOAT32.get()


@contextlib.contextmanager
def batch_invariance(on: bool, float32: bool = False) -> Iterator[None]:
    """Trace what runs inside with batch invariance `on` (or off), its float32 dots too if `float32`."""
    token, token32 = _ENABLED.set(bool(on)), _FLOAT32.set(bool(float32))
    try:
        yield
    finally:
        _ENABLED.reset(token)
        _FLOAT32.reset(token32)


def traced_in(
    context: Callable[[bool], contextlib.AbstractContextManager], on: bool, fn: Callable
) -> Callable:
    """`fn` whose body (so its trace, under `jax.jit`, in whatever thread lowers it) runs inside
    `context(on)`: a trace-time switch kept in a context variable (this module's, kernels/dot_rows.py's)."""

    @functools.wraps(fn)
    def under(*args, **kwargs):
        with context(on):
            return fn(*args, **kwargs)

    return under


def traced_with(on: bool, fn: Callable, float32: bool = False) -> Callable:
    """`fn` whose body (so its trace, under `jax.jit`) runs inside `batch_invariance(on, float32)`."""
    return traced_in(functools.partial(batch_invariance, float32=float32), on, fn)


_LANES = 16  # the tree stops at this width; the lanes are then added one by one


def invariant_sum(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """sum(x, axis) in an order set by x.shape[axis] alone (the module docstring says why)."""
    if not enabled():
        return jnp.sum(x, axis=axis, keepdims=keepdims)
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
    if not enabled():
        return jax.nn.log_softmax(x, axis=axis)
    shifted = x - jax.lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))
    return shifted - jnp.log(invariant_sum(jnp.exp(shifted), axis, keepdims=True))


def invariant_softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    if not enabled():
        return jax.nn.softmax(x, axis=axis)
    e = jnp.exp(x - jnp.max(x, axis=axis, keepdims=True))
    return e / invariant_sum(e, axis, keepdims=True)
