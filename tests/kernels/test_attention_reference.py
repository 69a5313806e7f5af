"""The reference paged attention (`ragged_paged_attention` + `write_kv`) against float64 numpy.

The cases (tests/attention_cases.py) lay sequences out as the engine does: a flat ragged batch of new
tokens, each sequence's context split into a cached prefix (already in its blocks) and this step's
new tokens (written by `write_kv`), block ids shuffled, padding tokens and padding sequences after
the real ones. Every block no table references is NaN, so a result that reads unreferenced memory
is NaN.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from helpers.attention_cases import BATCHES, CONFIGS, case_seed, run_case, tolerance
from xlaserve.kernels.reference import ragged_paged_attention


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_float64_reference(config, batch):
    cfg = CONFIGS[config]
    seqs = BATCHES[batch](cfg.layout.block_size)
    out, expected, k_cache, v_cache, info = run_case(cfg, seqs, case_seed(config, batch))
    n = info["num_real_tokens"]
    assert np.isfinite(out).all(), "unreferenced (NaN) cache memory leaked into the output"
    np.testing.assert_allclose(out[:n], expected[:n], **tolerance(cfg.dtype))
    np.testing.assert_array_equal(out[n:], 0.0)  # padding tokens

    # write_kv put every context token where the block table says, in the cache dtype.
    bs = cfg.layout.block_size
    for blocks, k_ctx, v_ctx in info["contexts"]:
        pos = np.arange(len(k_ctx))
        np.testing.assert_array_equal(k_cache[blocks[pos // bs], pos % bs], k_ctx)
        np.testing.assert_array_equal(v_cache[blocks[pos // bs], pos % bs], v_ctx)


def test_padding_does_not_affect_real_tokens():
    """Other padding contents (tokens, and the lengths of padding sequences), and fewer real
    neighbours, leave a sequence's rows bit-identical."""
    cfg = CONFIGS["gqa2"]
    seqs = BATCHES["mixed"](cfg.layout.block_size)
    n = sum(num for _, num in seqs)
    out_a, expected, *_ = run_case(cfg, seqs, seed=1234, padding_seed=0)
    out_b, *_ = run_case(cfg, seqs, seed=1234, padding_seed=1)
    np.testing.assert_array_equal(out_a, out_b)
    np.testing.assert_allclose(out_a[:n], expected[:n], **tolerance(cfg.dtype))

    # The first sequence alone (the rest is padding): its rows as in the batch, the rest zero.
    first_new = seqs[0][1]
    alone, *_ = run_case(cfg, seqs[:1], seed=1234, padding_seed=2)
    np.testing.assert_allclose(alone[:first_new], out_a[:first_new], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(alone[first_new:], 0.0)


def test_only_padding():
    """A step with no real sequence (a warm-up batch) returns zeros and reads no context."""
    cfg = CONFIGS["gqa2"]
    out, _, _, _, info = run_case(cfg, [], seed=7)
    assert info["num_real_tokens"] == 0
    np.testing.assert_array_equal(out, 0.0)


@pytest.mark.parametrize("batch", ["decode", "mixed"])
def test_nan_in_stale_slots_is_not_read(batch):
    """Slots a sequence's table reaches but its context does not (the tail of its last block, the
    null block of padded table entries) hold whatever an earlier request left there, possibly
    inf/NaN from an overflow. Masked scores must not let them into the result: 0 * NaN is NaN, so
    values past the context must be dropped, not just weighted by zero (vLLM zeroes them)."""
    cfg = CONFIGS["gqa2"]
    seqs = BATCHES[batch](cfg.layout.block_size)
    out, expected, *_ = run_case(cfg, seqs, case_seed("stale", batch), poison_tails=True)
    n = sum(num for _, num in seqs)
    np.testing.assert_allclose(out[:n], expected[:n], **tolerance(cfg.dtype))
    np.testing.assert_array_equal(out[n:], 0.0)


# Each sequence takes the decode, short or long (tiled) path (see kernels/reference.py); with the
# default split these cases' contexts are short, so no tile runs. These splits send every multi-token
# sequence (or all but the shortest) through tiles, with a tile size that divides nothing and key
# chunks of many pages; the result must not depend on the split.
_SPLITS = {
    "all_tiled": partial(ragged_paged_attention, tile_queries=16, tile_kv_tokens=32, short_context=0),
    "ragged_tiles": partial(ragged_paged_attention, tile_queries=7, tile_kv_tokens=48, short_context=20),
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
