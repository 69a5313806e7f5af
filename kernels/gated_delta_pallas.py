"""The per-chunk part of the gated delta rule (Qwen3.5's linear attention) as one Pallas kernel
(Triton lowering on GPU, interpret mode on CPU).

`kernels/gated_delta.py`'s chunked form cuts a step's tokens into chunks of Q that each belong to one
sequence; what a chunk computes without its entering state is independent of the other chunks: the
UT transform's u and w, the decayed causal scores, q and k decayed to the chunk's ends, and the
chunk's total decay (`gated_delta.chunk_terms_reference`, the spec). This kernel computes them, one
program per (chunk, head); the scan carrying the state from chunk to chunk stays in jnp.

In-kernel, everything is a dense [Q, Q] or [Q, D] tile, as Triton wants: the cumulative log-decay is
a masked row sum, and the UT transform's inverse (I + L)^-1 of the strictly lower triangular L is the
product (I - L)(I + L^2)(I + L^4)... over log2(Q) squarings, exact since L^Q = 0 (the reference
solves it by forward substitution, a loop over rows that a register tile cannot index).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_EXACT = jax.lax.Precision.HIGHEST  # float32 products (no TF32), like the reference


def delta_chunk_terms(
    q: jax.Array,  # [C, Q, H, Dk] float32 (normalized and scaled)
    k: jax.Array,  # [C, Q, H, Dk] float32 (normalized)
    v: jax.Array,  # [C, Q, H, Dv] float32
    g: jax.Array,  # [C, Q, H] float32: log-decay per token
    beta: jax.Array,  # [C, Q, H] float32
    *,
    interpret: bool = False,
):
    """-> (u [C, H, Q, Dv], w [C, H, Q, Dk], scores [C, H, Q, Q], q_in [C, H, Q, Dk], k_out [C, H, Q,
    Dk], chunk decay [C, H]), as `gated_delta.chunk_terms_reference`. Shapes are checked here; errors
    name the argument and the shape."""
    num_chunks, size, heads, dk = q.shape
    dv = v.shape[-1]
    expected = {
        "k": (num_chunks, size, heads, dk),
        "v": (num_chunks, size, heads, dv),
        "g": (num_chunks, size, heads),
        "beta": (num_chunks, size, heads),
    }
    for name, array in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        if array.shape != expected[name]:
            raise ValueError(f"{name} has shape {array.shape}, expected {expected[name]} (from q {q.shape})")
    return _delta_chunk_terms(q, k, v, g, beta, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("interpret",))
def _delta_chunk_terms(q, k, v, g, beta, *, interpret):
    num_chunks, size, heads, dk = q.shape
    dv = v.shape[-1]

    def per_head(d):  # [C, Q, H, d] in, the (chunk, head) axes squeezed
        return pl.BlockSpec((None, size, None, d), lambda c, h: (c, 0, h, 0))

    def out_head(d):  # [C, H, Q, d] out
        return pl.BlockSpec((None, None, size, d), lambda c, h: (c, h, 0, 0))

    per_token = pl.BlockSpec((None, size, None), lambda c, h: (c, 0, h))

    def f32(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32)

    u, w, scores, q_in, k_out, decay = pl.pallas_call(
        _chunk_kernel,
        grid=(num_chunks, heads),
        in_specs=[per_head(dk), per_head(dk), per_head(dv), per_token, per_token],
        out_specs=[
            out_head(dv),
            out_head(dk),
            out_head(size),
            out_head(dk),
            out_head(dk),
            pl.BlockSpec((None, None, size), lambda c, h: (c, h, 0)),
        ],
        out_shape=[
            f32(num_chunks, heads, size, dv),
            f32(num_chunks, heads, size, dk),
            f32(num_chunks, heads, size, size),
            f32(num_chunks, heads, size, dk),
            f32(num_chunks, heads, size, dk),
            f32(num_chunks, heads, size),
        ],
        interpret=interpret,
        # Triton, not Mosaic GPU (Pallas' GPU default), like the attention kernels.
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        name="gated_delta_chunk_terms",
    )(q, k, v, g, beta)
    return u, w, scores, q_in, k_out, decay[..., 0]


def _chunk_kernel(
    q_ref, k_ref, v_ref, g_ref, beta_ref, u_ref, w_ref, scores_ref, q_in_ref, k_out_ref, decay_ref
):
    """One chunk and head: q, k [Q, Dk], v [Q, Dv], g and beta [Q]."""
    q, k, v, g, beta = q_ref[...], k_ref[...], v_ref[...], g_ref[...], beta_ref[...]
    size = q.shape[0]
    rows = jax.lax.broadcasted_iota(jnp.int32, (size, size), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (size, size), 1)
    causal, strictly_lower = cols <= rows, cols < rows
    cum = jnp.sum(jnp.where(causal, g[None, :], 0.0), axis=1)  # [Q]: log-decay from the chunk's start
    # exp only where visible: above the diagonal cum_i - cum_j > 0 and could overflow.
    decay = jnp.where(causal, jnp.exp(jnp.where(causal, cum[:, None] - cum[None, :], -jnp.inf)), 0.0)
    k_beta = k * beta[:, None]
    lower = jnp.where(strictly_lower, jnp.dot(k_beta, k.T, precision=_EXACT) * decay, 0.0)
    # (I + L)^-1 = (I - L)(I + L^2)(I + L^4)...: L is nilpotent (L^Q = 0).
    eye = (rows == cols).astype(jnp.float32)
    inverse = eye - lower
    power = lower
    for _ in range(max(0, (size - 1).bit_length() - 1)):
        power = jnp.dot(power, power, precision=_EXACT)
        inverse = jnp.dot(inverse, eye + power, precision=_EXACT)
    u_ref[...] = jnp.dot(inverse, v * beta[:, None], precision=_EXACT)
    w_ref[...] = jnp.dot(inverse, k_beta * jnp.exp(cum)[:, None], precision=_EXACT)
    scores_ref[...] = jnp.dot(q, k.T, precision=_EXACT) * decay
    q_in_ref[...] = q * jnp.exp(cum)[:, None]
    # cum at the chunk's last slot, by a masked sum: Triton lowers no slice of a loaded block.
    cum_end = jnp.sum(jnp.where(jax.lax.broadcasted_iota(jnp.int32, (size,), 0) == size - 1, cum, 0.0))
    k_out_ref[...] = k * jnp.exp(cum_end - cum)[:, None]
    decay_ref[...] = jnp.full((size,), jnp.exp(cum_end), jnp.float32)
