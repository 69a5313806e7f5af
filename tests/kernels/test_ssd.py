"""Mamba2's ragged conv and SSD scan (kernels/ssd.py) against a float64 numpy recurrence, token by
token per sequence: chunked (sequences cut mid-chunk, entering states, padding) and decode steps;
and the Pallas per-chunk kernel (kernels/ssd_pallas.py) in interpret mode."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.kernels.backend import select_backend
from xlaserve.kernels.ssd import chunk_terms_reference, ragged_causal_conv1d, ragged_ssd
from xlaserve.kernels.ssd_pallas import ssd_chunk_terms

H, P, G, N, K, CD = 4, 3, 2, 5, 4, 7
# Jitted whole: op by op, each of their small ops would compile on its own (seconds under load).
ssd = jax.jit(ragged_ssd, static_argnames=("chunk_size", "chunk_terms"))
conv = jax.jit(ragged_causal_conv1d)


def numpy_ssd(x, dt, a, b, c, d, qsl, init):
    """The recurrence itself, in float64, one token at a time."""
    y = np.zeros(x.shape, np.float64)
    final = init.astype(np.float64).copy()
    rep = H // G
    for r in range(len(qsl) - 1):
        h = init[r].astype(np.float64)
        for t in range(qsl[r], qsl[r + 1]):
            bh, ch = np.repeat(b[t], rep, 0), np.repeat(c[t], rep, 0)  # [H, N]
            h = np.exp(dt[t] * a)[:, None, None] * h + (dt[t][:, None] * x[t])[:, :, None] * bh[:, None, :]
            y[t] = np.einsum("hpn,hn->hp", h, ch) + d[:, None] * x[t]
        final[r] = h
    return y, final


def numpy_conv(x, w, bias, state, qsl):
    out = np.zeros(x.shape, np.float64)
    new_state = state.astype(np.float64).copy()
    for r in range(len(qsl) - 1):
        seq = np.concatenate([state[r], x[qsl[r] : qsl[r + 1]]])  # [K - 1 + n, Cd]
        for i in range(qsl[r + 1] - qsl[r]):
            out[qsl[r] + i] = np.einsum("kc,ck->c", seq[i : i + K], w) + bias
        new_state[r] = seq[len(seq) - (K - 1) :]
    return out, new_state


def case(lengths, num_tokens, seed):
    rng = np.random.default_rng(seed)
    qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    r = len(lengths)
    return dict(
        x=rng.normal(size=(num_tokens, H, P)),
        dt=rng.uniform(0.05, 0.8, (num_tokens, H)),
        a=-rng.uniform(0.5, 2.0, H),
        b=rng.normal(size=(num_tokens, G, N)),
        c=rng.normal(size=(num_tokens, G, N)),
        d=rng.normal(size=H),
        qsl=qsl,
        init=rng.normal(size=(r, H, P, N)) * (rng.uniform(size=(r, 1, 1, 1)) < 0.7),
    )


# One shape (32 tokens, 5 sequences) for all three: one compile.
@pytest.mark.parametrize(
    "lengths",
    [
        [11, 1, 9, 0, 0],  # cut mid-chunk, a decode row, padding sequences and tokens
        [20, 0, 0, 0, 0],  # one sequence over three chunks
        [1, 1, 1, 0, 0],  # decode: the recurrent form
    ],
)
def test_ssd_matches_float64_recurrence(lengths):
    k = case(lengths, 32, seed=sum(lengths))
    y, final = ssd(
        *(jnp.asarray(k[n], jnp.float32) for n in ("x", "dt", "a", "b", "c", "d")),
        jnp.asarray(k["qsl"]),
        jnp.asarray(k["init"], jnp.float32),
        chunk_size=8,
    )
    ry, rfinal = numpy_ssd(*(k[n] for n in ("x", "dt", "a", "b", "c", "d", "qsl", "init")))
    n = k["qsl"][-1]
    np.testing.assert_allclose(np.asarray(y)[:n], ry[:n], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(final), rfinal, rtol=2e-5, atol=2e-5)


def test_conv_reads_the_state_before_the_step():
    rng = np.random.default_rng(3)
    lengths, num_tokens = [5, 1, 2, 0], 16
    qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    x = rng.normal(size=(num_tokens, CD))
    w, bias = rng.normal(size=(CD, K)), rng.normal(size=CD)
    state = rng.normal(size=(len(lengths), K - 1, CD))
    out, new_state = conv(*(jnp.asarray(v, jnp.float32) for v in (x, w, bias, state)), jnp.asarray(qsl))
    rout, rstate = numpy_conv(x, w, bias, state, qsl)
    np.testing.assert_allclose(np.asarray(out)[: qsl[-1]], rout[: qsl[-1]], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(new_state), rstate, rtol=1e-6, atol=1e-6)


def test_pallas_chunk_kernel_matches_the_reference_in_interpret_mode():
    """The per-chunk kernel against `chunk_terms_reference`, alone and inside the ragged scan."""
    rng = np.random.default_rng(5)
    num_chunks, q = 3, 8
    xdt = rng.normal(size=(num_chunks, q, H, P))
    cum = np.cumsum(-rng.uniform(0.05, 1.0, (num_chunks, q, H)), axis=1)
    bh, ch = rng.normal(size=(2, num_chunks, q, H, N))
    args = [jnp.asarray(v, jnp.float32) for v in (xdt, cum, bh, ch)]
    for ours, ref in zip(ssd_chunk_terms(*args, interpret=True), chunk_terms_reference(*args)):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cum has shape"):
        ssd_chunk_terms(args[0], args[1][:, :4], args[2], args[3], interpret=True)
    k = case([11, 1, 9, 0, 0], 32, seed=5)
    y, final = ssd(
        *(jnp.asarray(k[n], jnp.float32) for n in ("x", "dt", "a", "b", "c", "d")),
        jnp.asarray(k["qsl"]),
        jnp.asarray(k["init"], jnp.float32),
        chunk_size=8,
        chunk_terms=functools.partial(ssd_chunk_terms, interpret=True),
    )
    ry, rfinal = numpy_ssd(*(k[n] for n in ("x", "dt", "a", "b", "c", "d", "qsl", "init")))
    np.testing.assert_allclose(np.asarray(y)[:21], ry[:21], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(final), rfinal, rtol=2e-5, atol=2e-5)


def test_pallas_chunk_kernel_lowers_to_one_triton_call():
    """Mamba2-130m's chunk shapes (Q 64, P 64, N 128, 24 heads) lower for CUDA on this CPU machine."""
    shapes = [(4, 64, 24, 64), (4, 64, 24), (4, 64, 24, 128), (4, 64, 24, 128)]
    args = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in shapes]
    text = jax.jit(ssd_chunk_terms).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"stablehlo.custom_call @([\w$.]+)", text) == ["__gpu$xla.gpu.triton"]


def test_the_pallas_backend_carries_the_chunk_kernel():
    """Asked for by name, 'pallas' gives Mamba2 the chunk kernel (interpret mode on CPU); the reference
    and auto keep the jnp chunk terms."""
    pallas = select_backend("pallas", "cpu")
    assert pallas.ssd_chunk_terms.func is ssd_chunk_terms and pallas.ssd_chunk_terms.keywords == {
        "interpret": True
    }
    assert select_backend("reference", "cpu").ssd_chunk_terms is chunk_terms_reference
    assert select_backend("auto", "cpu").ssd_chunk_terms is chunk_terms_reference
