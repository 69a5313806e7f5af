"""The reference attention's three paths (decode, short, long tiled: kernels/reference.py) each
match the float64 oracle; the common contract (every backend) is in test_attention_contract.py."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from helpers.attention_cases import BATCHES, CONFIGS, attend_ahead_case, case_seed, run_case, tolerance
from xlaserve.kernels.invariant import batch_invariance
from xlaserve.kernels.reference import ragged_paged_attention


def _tiled(**split):
    """The reference with `split`, traced with batch invariance off: on, no query takes the tiles."""

    def attention(*args, **kwargs):
        with batch_invariance(False):
            return ragged_paged_attention(*args, **split, **kwargs)

    return attention


# With the default split these cases' contexts are short, so no tile runs. These splits send every
# multi-token sequence (or all but the shortest) through tiles, with a tile size that divides nothing
# and key chunks of many pages, or every sequence of up to 16 new tokens through the few path; the
# result must not depend on the split.
_SPLITS = {
    "all_tiled": _tiled(tile_queries=16, tile_kv_tokens=32, short_context=0, few_queries=1),
    "ragged_tiles": _tiled(tile_queries=7, tile_kv_tokens=48, short_context=20, few_queries=1),
    "few": partial(ragged_paged_attention, short_context=0, few_queries=16),
}


@pytest.mark.parametrize("split", list(_SPLITS))
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("config", ["gqa2", "gqa8_window", "gqa2_window_cap", "block5_chunk1"])
def test_every_path_matches_float64(config, batch, split):
    cfg = CONFIGS[config]
    seqs = BATCHES[batch](cfg.layout.block_size)
    for poison_tails in (False, True):
        out, expected, *_ = run_case(
            cfg, seqs, case_seed(config, batch), attention=_SPLITS[split], poison_tails=poison_tails
        )
        n = sum(num for _, num in seqs)
        assert np.isfinite(out).all(), "unreferenced (NaN) cache memory leaked into the output"
        np.testing.assert_allclose(out[:n], expected[:n], **tolerance(cfg.dtype))
        np.testing.assert_array_equal(out[n:], 0.0)


def test_traced_window_in_tiles():
    """A layer's window as a traced value (the layer scan) bounds the tiles' key loop too."""
    cfg = CONFIGS["gqa8_window"]
    seqs = BATCHES["mixed"](cfg.layout.block_size)
    out, expected, *_ = run_case(cfg, seqs, 11, attention=_SPLITS["all_tiled"], traced_window=True)
    n = sum(num for _, num in seqs)
    np.testing.assert_allclose(out[:n], expected[:n], **tolerance(cfg.dtype))


@pytest.mark.parametrize("few_queries", [8, 1])
def test_each_path_runs_under_its_own_cond(few_queries):
    """A path no sequence takes costs nothing: its setup (folded queries, accumulators, scatter) sits
    in a branch of its own `conditional`, one per path (short, decode, long, and few unless it is
    off). Inlined, the idle paths cost ~60% of a batch-64 decode step's attention on CPU."""
    import jax
    import jax.numpy as jnp

    num_tokens, num_seqs, blocks, block_size = 16, 4, 8, 4
    args = (
        jnp.zeros((num_tokens, 4, 8), jnp.bfloat16),
        jnp.zeros((32, block_size, 2, 8), jnp.uint16),
        jnp.zeros((32, block_size, 2, 8), jnp.uint16),
        jnp.ones(num_seqs, jnp.int32),
        jnp.zeros((num_seqs, blocks), jnp.int32),
        jnp.arange(num_seqs + 1, dtype=jnp.int32),
        jnp.int32(num_seqs),
    )

    def num_conds() -> int:
        step = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=0.5, few_queries=few_queries))
        hlo = step.lower(*args).compile().as_text()
        return hlo[hlo.index("ENTRY") :].count(" conditional(")

    with batch_invariance(False):
        assert num_conds() == (4 if few_queries > 1 else 3)
    # Batch-invariant, long chunks take the short path (or the C++ op): no long path to branch to.
    assert num_conds() == (3 if few_queries > 1 else 2)


@pytest.mark.parametrize("split", list(_SPLITS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attend_ahead_opens_a_span_both_ways(split, dtype):
    """`attend_ahead` (Gemma 3's images: each token of a span sees the whole span) against a float64
    oracle on every path (helpers/attention_cases.py `attend_ahead_case`). The 16-bit cache is stored
    as words and takes the folded path (the C++ op is causal only)."""
    operands, kwargs, expected = attend_ahead_case(dtype, words=True)
    out = _SPLITS[split](*operands, **kwargs)
    tol = 1e-5 if dtype == "float32" else 3e-2
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=tol, atol=tol)
