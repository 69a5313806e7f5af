"""The per-chunk part of Mamba2's SSD scan as one Pallas kernel (interpret mode on CPU).

`kernels/ssd.py` cuts a step's tokens into chunks of Q that each belong to one sequence; everything
inside a chunk is independent of the other chunks: the output from the chunk's own tokens (a
masked, decayed (C . B) product, like causal attention with a decay instead of a softmax) and the
chunk's contribution to the state at its end. This kernel computes both, one program per (chunk,
head); the short scan that carries states from chunk to chunk stays in jnp (`_chunked`). Its
reference is `ssd.chunk_terms_reference`, the same function over the whole array.

Not yet: the Triton lowering (its dots need Q, P and N to be powers of two >= 16, which Mamba2's
checkpoints have: Q = 64, P = 64, N = 128) checked on a GPU, and the inter-chunk scan fused in.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def ssd_chunk_terms(
    xdt: jax.Array,  # [C, Q, H, P] float32: x * dt
    cum: jax.Array,  # [C, Q, H] float32: cumulative dt * a from the chunk's start
    bh: jax.Array,  # [C, Q, H, N] float32
    ch: jax.Array,  # [C, Q, H, N] float32
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """-> (y within each chunk [C, Q, H, P], each chunk's own end state [C, H, P, N]), as
    `ssd.chunk_terms_reference`. Shapes are checked here; errors name the argument and the shape."""
    num_chunks, q, heads, p = xdt.shape
    n = bh.shape[-1]
    expected = {
        "cum": (num_chunks, q, heads),
        "bh": (num_chunks, q, heads, n),
        "ch": (num_chunks, q, heads, n),
    }
    for name, array in (("cum", cum), ("bh", bh), ("ch", ch)):
        if array.shape != expected[name]:
            raise ValueError(
                f"{name} has shape {array.shape}, expected {expected[name]} (from xdt {xdt.shape})"
            )
    return _ssd_chunk_terms(xdt, cum, bh, ch, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("interpret",))
def _ssd_chunk_terms(xdt, cum, bh, ch, *, interpret):
    num_chunks, q, heads, p = xdt.shape
    n = bh.shape[-1]
    # One program per (chunk, head); the chunk and head axes of each block are squeezed (None).
    per_head = pl.BlockSpec((None, q, None, p), lambda c, h: (c, 0, h, 0))
    per_head_n = pl.BlockSpec((None, q, None, n), lambda c, h: (c, 0, h, 0))
    return pl.pallas_call(
        _chunk_kernel,
        grid=(num_chunks, heads),
        in_specs=[per_head, pl.BlockSpec((None, q, None), lambda c, h: (c, 0, h)), per_head_n, per_head_n],
        out_specs=[per_head, pl.BlockSpec((None, None, p, n), lambda c, h: (c, h, 0, 0))],
        out_shape=[
            jax.ShapeDtypeStruct((num_chunks, q, heads, p), jnp.float32),
            jax.ShapeDtypeStruct((num_chunks, heads, p, n), jnp.float32),
        ],
        interpret=interpret,
        # Triton, not Mosaic GPU (Pallas' GPU default), like the attention kernels.
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
    )(xdt, cum, bh, ch)


def _chunk_kernel(xdt_ref, cum_ref, b_ref, c_ref, y_ref, state_ref):
    """One chunk and head: xdt [Q, P], cum [Q], B and C [Q, N] -> y [Q, P], end state [P, N]."""
    xdt, cum, b, c = xdt_ref[...], cum_ref[...], b_ref[...], c_ref[...]
    q = xdt.shape[0]
    rows = jax.lax.broadcasted_iota(jnp.int32, (q, q), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (q, q), 1)
    causal = cols <= rows
    # exp only where visible: above the diagonal cum_q - cum_s > 0 and could overflow.
    decay = jnp.where(causal, jnp.exp(jnp.where(causal, cum[:, None] - cum[None, :], -jnp.inf)), 0.0)
    scores = jnp.dot(c, b.T, preferred_element_type=jnp.float32) * decay  # [Q, Q]
    y_ref[...] = jnp.dot(scores, xdt, preferred_element_type=jnp.float32)
    # cum at the chunk's last slot, by a masked sum: Triton lowers no slice of a loaded block.
    cum_end = jnp.sum(jnp.where(jax.lax.broadcasted_iota(jnp.int32, (q,), 0) == q - 1, cum, 0.0))
    to_end = jnp.exp(cum_end - cum)  # [Q]
    state_ref[...] = jnp.dot((xdt * to_end[:, None]).T, b, preferred_element_type=jnp.float32)  # [P, N]
