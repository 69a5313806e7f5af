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
WIDTHS = (64, 128, 576, 1536, 2048, 49152)


@jax.jit
def _row_sums(squared: list, exponentiated: list) -> tuple[list, list]:
    """Every width's two reductions in one program per row count (not one per width and form): each
    operand is its own parameter, so each reduction is a fusion of its own, as it would be alone."""
    return [invariant_sum(x * x) for x in squared], [invariant_sum(jnp.exp(x)) for x in exponentiated]


def test_a_row_sums_to_the_same_bits_in_any_number_of_rows():
    xs = [np.random.default_rng(w).standard_normal((max(ROW_COUNTS), w)).astype(np.float32) for w in WIDTHS]

    def first_rows(rows: int) -> list[np.ndarray]:  # row 0 of each (width, form), as computed in `rows` rows
        squared, exponentiated = _row_sums([x[:rows] for x in xs], [x[:rows] for x in xs])
        return [np.asarray(r)[0] for r in squared + exponentiated]

    alone = first_rows(1)
    names = [f"{form} width {w}" for form in ("x * x", "exp(x)") for w in WIDTHS]
    for rows in ROW_COUNTS:
        for name, got, expected in zip(names, first_rows(rows), alone, strict=True):
            np.testing.assert_array_equal(got, expected, err_msg=f"{name}, {rows} rows")


def test_values_match_float64():
    x = np.random.default_rng(0).standard_normal((4, 3, 1000)).astype(np.float32) * 4
    x64 = x.astype(np.float64)
    ref = x64 - x64.max(-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))

    @jax.jit  # one program: run op by op, the tree's every slice and add would compile its own
    def reductions(x):
        return (
            invariant_sum(x, axis=1),
            invariant_mean(x, keepdims=True),
            invariant_log_softmax(x),
            invariant_softmax(x),
        )

    total, mean, log_softmax, softmax = reductions(x)
    np.testing.assert_allclose(total, x64.sum(1), atol=1e-5)
    np.testing.assert_allclose(mean, x.mean(-1, keepdims=True), rtol=1e-5)
    np.testing.assert_allclose(log_softmax, ref, atol=2e-5)
    np.testing.assert_allclose(softmax, np.exp(ref), atol=1e-6)


def test_masked_entries_add_nothing():
    x = jnp.asarray([[0.5, -jnp.inf, 1.5, -jnp.inf]], jnp.float32)
    np.testing.assert_allclose(
        jax.jit(invariant_softmax)(x), [[1 / (1 + np.e), 0, np.e / (1 + np.e), 0]], rtol=1e-6
    )


def test_switched_off_they_are_xlas_own_reductions():
    """Off (`--no-batch-invariant`), the same values through jnp's reductions: traced under the switch,
    so a program traced inside `batch_invariance(False)` has no fixed tree. (Each trace gets its own
    function: JAX caches a function's trace by its identity and shapes, not by this switch.)"""
    from xlaserve.kernels.invariant import batch_invariance, enabled, traced_with

    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 576)), jnp.float32)
    assert enabled()
    with batch_invariance(False):
        assert not enabled()
        off = jax.make_jaxpr(lambda x: invariant_sum(x))(x)
    assert enabled()
    on = jax.make_jaxpr(lambda x: invariant_sum(x))(x)
    assert [e.primitive.name for e in off.eqns] == ["reduce_sum"]
    assert "reduce_sum" not in {e.primitive.name for e in on.eqns}
    traced_off = jax.make_jaxpr(traced_with(False, lambda x: invariant_sum(x * x)))(x)
    assert "reduce_sum" in {e.primitive.name for e in traced_off.eqns}
    np.testing.assert_allclose(
        jax.jit(traced_with(False, invariant_sum))(x), jax.jit(invariant_sum)(x), atol=1e-4
    )


def _long_prompt_step(ctx: int, chunks: list[int], cache: str = "bfloat16"):
    """Attention inputs for one sequence's `ctx`-token context (a bfloat16 or float8 cache, as the engine
    stores it: uint16 or uint8 words), and the steps that compute its queries in `chunks` (sizes summing
    to ctx)."""
    from xlaserve.kernels.dtype_ops import as_words
    from xlaserve.kernels.reference import FP8_E4M3, to_fp8
    from xlaserve.kernels.synthetic import StepShape, synthetic_step

    q, k, v, _, tables, _, _ = synthetic_step(
        StepShape(seqs=((ctx, ctx),), num_q_heads=9, num_kv_heads=3, head_dim=64), seed=3
    )
    if cache == "float8":
        k, v = to_fp8(k, FP8_E4M3), to_fp8(v, FP8_E4M3)
    q, steps, start = np.asarray(q), [], 0  # sliced on the host: a device slice compiles per shape
    for n in chunks:
        loc = np.asarray([0, n], np.int32)
        steps.append((q[start : start + n], np.asarray([start + n], np.int32), loc))
        start += n
    return (as_words(k), as_words(v), tables), steps


@pytest.mark.parametrize("cache", ["bfloat16", "float8"])
def test_a_long_prompt_attends_to_the_same_bits_however_it_is_chunked(cache):
    """With the C++ op (a bfloat16 cache on CPU), a 300-token prompt's queries give the same bits in one
    step (past the short-context limit: the tiled path when invariance is off) as in three chunks (two
    short steps and a long one), and as decoded one by one. Off, the tiles round differently. A float8
    cache (`--kv-cache-dtype fp8`), which the op does not read, holds it through the jnp paths."""
    from xlaserve.kernels import cpu_ops, reference
    from xlaserve.kernels.invariant import batch_invariance

    if cache == "bfloat16" and not cpu_ops.available():
        pytest.skip("the C++ attention op did not build here")
    ctx = 300
    attend = jax.jit(
        lambda q, k, v, lens, tables, loc: reference.ragged_paged_attention(
            q, k, v, lens, tables, loc, jnp.int32(1), sm_scale=0.125
        )
    )

    def run(chunks):
        (k, v, tables), steps = _long_prompt_step(ctx, chunks, cache)
        return np.concatenate([np.asarray(attend(q, k, v, lens, tables, loc)) for q, lens, loc in steps])

    whole = run([ctx])
    np.testing.assert_array_equal(run([128, 128, 44]), whole)
    np.testing.assert_array_equal(run([1] * 8 + [292]), whole)
    last = run([ctx - 5, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(last, whole)
    with batch_invariance(False):
        attend = jax.jit(
            lambda q, k, v, lens, tables, loc: reference.ragged_paged_attention(
                q, k, v, lens, tables, loc, jnp.int32(1), sm_scale=0.125
            )
        )
        tiled = run([ctx])
    assert not np.array_equal(tiled, whole)  # the long path's online softmax rounds otherwise
    np.testing.assert_allclose(tiled.astype(np.float32), whole.astype(np.float32), atol=2e-2)
