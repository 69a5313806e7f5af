"""The batch-invariant reductions: each row's bits depend on that row alone, and the values are sums."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.kernels.invariant import invariant_log_softmax, invariant_mean, invariant_softmax, invariant_sum

ROW_COUNTS = (1, 2, 3, 7, 8, 9, 16, 64, 257)


# The widths the models reduce over (head_dim, hidden sizes, vocabularies). Below 16 lanes the tree is
# one chain of adds, which XLA vectorizes across rows and LLVM may contract with a feeding multiply into
# fused multiply-adds in one form and not the other: no width of a model is that narrow.
@pytest.mark.parametrize("width", [64, 128, 576, 1536, 2048, 49152])
def test_a_row_sums_to_the_same_bits_in_any_number_of_rows(width):
    x = jnp.asarray(np.random.default_rng(width).standard_normal((max(ROW_COUNTS), width)), jnp.float32)
    for fn in (jax.jit(lambda x: invariant_sum(x * x)), jax.jit(lambda x: invariant_sum(jnp.exp(x)))):
        alone = np.asarray(fn(x[:1]))[0]
        for rows in ROW_COUNTS:
            np.testing.assert_array_equal(np.asarray(fn(x[:rows]))[0], alone, err_msg=f"{rows} rows")


def test_values_match_float64():
    x = np.random.default_rng(0).standard_normal((4, 3, 1000)).astype(np.float32) * 4
    np.testing.assert_allclose(invariant_sum(jnp.asarray(x), axis=1), x.astype(np.float64).sum(1), atol=1e-5)
    np.testing.assert_allclose(
        invariant_mean(jnp.asarray(x), keepdims=True), x.mean(-1, keepdims=True), rtol=1e-5
    )
    x64 = x.astype(np.float64)
    ref = x64 - x64.max(-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    np.testing.assert_allclose(invariant_log_softmax(jnp.asarray(x)), ref, atol=2e-5)
    np.testing.assert_allclose(invariant_softmax(jnp.asarray(x)), np.exp(ref), atol=1e-6)


def test_masked_entries_add_nothing():
    x = jnp.asarray([[0.5, -jnp.inf, 1.5, -jnp.inf]], jnp.float32)
    np.testing.assert_allclose(invariant_softmax(x), [[1 / (1 + np.e), 0, np.e / (1 + np.e), 0]], rtol=1e-6)
