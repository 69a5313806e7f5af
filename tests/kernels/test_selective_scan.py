"""Mamba's selective scan (kernels/selective_scan.py) against a float64 numpy recurrence, on a ragged
batch laid out as the engine lays it out (sequences with entering states, one at position 0, a decode
token, padding tokens and padding sequences), and batch invariance: a sequence's outputs and final
state alone are the same bits as among companions, and the same when its tokens come in two steps."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from xlaserve.kernels.selective_scan import ragged_selective_scan

CHANNELS, STATE = 12, 5
LENGTHS = (7, 1, 13, 4)  # new tokens of each real sequence
NUM_TOKENS, NUM_SEQS = 32, 6  # padded


def _inputs(seed: int, lengths=LENGTHS):
    rng = np.random.default_rng(seed)
    qsl = np.zeros(NUM_SEQS + 1, np.int32)
    qsl[1 : len(lengths) + 1] = np.cumsum(lengths)
    qsl[len(lengths) + 1 :] = qsl[len(lengths)]
    x = rng.standard_normal((NUM_TOKENS, CHANNELS)).astype(np.float32)
    dt = np.log1p(np.exp(rng.standard_normal((NUM_TOKENS, CHANNELS)))).astype(np.float32)  # softplus
    a = -np.exp(rng.standard_normal((CHANNELS, STATE))).astype(np.float32)
    b = rng.standard_normal((NUM_TOKENS, STATE)).astype(np.float32)
    c = rng.standard_normal((NUM_TOKENS, STATE)).astype(np.float32)
    d = rng.standard_normal(CHANNELS).astype(np.float32)
    h0 = rng.standard_normal((NUM_SEQS, CHANNELS, STATE)).astype(np.float32)
    return x, dt, a, b, c, d, qsl, h0


def _numpy(x, dt, a, b, c, d, qsl, h0, num_real):
    x, dt, a, b, c, d, h = (np.asarray(v, np.float64) for v in (x, dt, a, b, c, d, h0))
    h = h.copy()
    y = np.zeros_like(x)
    for s in range(num_real):
        for t in range(qsl[s], qsl[s + 1]):
            h[s] = np.exp(dt[t][:, None] * a) * h[s] + dt[t][:, None] * b[t][None, :] * x[t][:, None]
            y[t] = h[s] @ c[t] + d * x[t]
    return y, h


_SCAN = jax.jit(ragged_selective_scan)


@pytest.mark.parametrize("seed", [0, 1])
def test_matches_float64_recurrence(seed):
    args = _inputs(seed)
    y, final = _SCAN(*args)
    expected_y, expected_h = _numpy(*args, num_real=len(LENGTHS))
    n = sum(LENGTHS)
    np.testing.assert_allclose(np.asarray(y)[:n], expected_y[:n], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(y)[n:], 0.0)  # padding tokens
    np.testing.assert_allclose(
        np.asarray(final)[: len(LENGTHS)], expected_h[: len(LENGTHS)], rtol=1e-5, atol=1e-5
    )
    # Padding sequences own no token: their states pass through unchanged.
    np.testing.assert_array_equal(np.asarray(final)[len(LENGTHS) :], args[-1][len(LENGTHS) :])


def test_a_sequence_alone_and_among_companions_and_in_two_steps_is_the_same_bits():
    x, dt, a, b, c, d, qsl, h0 = _inputs(3)
    first = slice(qsl[2], qsl[3])  # the third sequence: 13 tokens
    y_batch, h_batch = _SCAN(x, dt, a, b, c, d, qsl, h0)

    def alone(rows, h_in):
        """Those tokens as the only sequence of a step (at the front, the rest padding)."""
        n = rows.stop - rows.start
        moved = [np.zeros_like(v) for v in (x, dt, b, c)]
        for m, v in zip(moved, (x, dt, b, c)):
            m[:n] = v[rows]
        q = np.zeros(NUM_SEQS + 1, np.int32)
        q[1:] = n
        h = np.zeros_like(h0)
        h[0] = h_in
        y, h_out = _SCAN(moved[0], moved[1], a, moved[2], moved[3], d, q, h)
        return np.asarray(y)[:n], np.asarray(h_out)[0]

    y_alone, h_alone = alone(first, h0[2])
    np.testing.assert_array_equal(y_alone, np.asarray(y_batch)[first])
    np.testing.assert_array_equal(h_alone, np.asarray(h_batch)[2])
    # Cut into two steps, the state carried between them.
    cut = first.start + 5
    y1, h_mid = alone(slice(first.start, cut), h0[2])
    y2, h_end = alone(slice(cut, first.stop), h_mid)
    np.testing.assert_array_equal(np.concatenate([y1, y2]), y_alone)
    np.testing.assert_array_equal(h_end, h_alone)


def test_mismatched_shapes_are_named():
    x, dt, a, b, c, d, qsl, h0 = _inputs(0)
    with pytest.raises(ValueError, match="selective scan: x"):
        ragged_selective_scan(x, dt, a[:3], b, c, d, qsl, h0)
