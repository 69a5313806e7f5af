"""Mamba2's ragged conv and SSD scan (kernels/ssd.py) against a float64 numpy recurrence, token by
token per sequence: chunked (sequences cut mid-chunk, entering states, padding) and decode steps."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.kernels.ssd import ragged_causal_conv1d, ragged_ssd

H, P, G, N, K, CD = 4, 3, 2, 5, 4, 7


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


@pytest.mark.parametrize(
    "lengths,num_tokens",
    [
        ([11, 1, 9, 0, 0], 32),  # cut mid-chunk, a decode row, padding sequences and tokens
        ([20], 32),  # one sequence over three chunks
        ([1, 1, 1, 0], 16),  # decode: the recurrent form
    ],
)
def test_ssd_matches_float64_recurrence(lengths, num_tokens):
    k = case(lengths, num_tokens, seed=len(lengths))
    y, final = ragged_ssd(
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
    out, new_state = ragged_causal_conv1d(
        *(jnp.asarray(v, jnp.float32) for v in (x, w, bias, state)), jnp.asarray(qsl)
    )
    rout, rstate = numpy_conv(x, w, bias, state, qsl)
    np.testing.assert_allclose(np.asarray(out)[: qsl[-1]], rout[: qsl[-1]], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(new_state), rstate, rtol=1e-6, atol=1e-6)
