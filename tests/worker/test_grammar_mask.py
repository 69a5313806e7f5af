"""The grammar's token bitmask on the device against numpy: packed bits (bit i of int32 word w allows
token 32w + i), a vocabulary padded past the tokenizer's, and rows that no grammar constrains."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.sharding.vocab import mask_padded_vocab
from xlaserve.worker.input_batch import fit_bitmask
from xlaserve.worker.sampler import SamplingTensors, apply_token_bitmask, sample

_apply = jax.jit(apply_token_bitmask)
_sample = jax.jit(sample, static_argnames=("with_logprobs",))


def make_tensors(num_rows: int, *, temperature: float = 0.0, bitmask=None) -> SamplingTensors:
    """Unfiltered rows at one temperature, seeded by row; `bitmask` [R, W] int32 or None."""
    return SamplingTensors(
        temperature=jnp.full(num_rows, temperature, jnp.float32),
        top_k=jnp.zeros(num_rows, jnp.int32),
        top_p=jnp.ones(num_rows, jnp.float32),
        min_p=jnp.zeros(num_rows, jnp.float32),
        seeds=jnp.arange(num_rows, dtype=jnp.uint32),
        token_index=jnp.zeros(num_rows, jnp.int32),
        allowed_token_bitmask=None if bitmask is None else jnp.asarray(bitmask),
    )


def pack(allowed: np.ndarray) -> np.ndarray:
    """[R, V] bool -> [R, ceil(V / 32)] int32, as llguidance packs a mask (little-endian bit order)."""
    num_rows, vocab = allowed.shape
    padded = np.zeros((num_rows, -(-vocab // 32) * 32), bool)
    padded[:, :vocab] = allowed
    return np.packbits(padded, axis=1, bitorder="little").view("<i4").astype(np.int32)


def reference(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """numpy: unpack every bit, keep the logits of allowed tokens, -inf elsewhere."""
    bits = np.unpackbits(bitmask.astype("<i4").view(np.uint8), axis=1, bitorder="little")
    return np.where(bits[:, : logits.shape[1]].astype(bool), logits, -np.inf)


@pytest.mark.parametrize("vocab", [32, 45, 64, 100, 257])
def test_mask_matches_numpy(vocab):
    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((8, vocab)).astype(np.float32)
    allowed = rng.random((8, vocab)) < 0.3
    allowed[0] = True  # a row no grammar constrains: all bits set, word -1
    allowed[1, :] = False
    allowed[1, vocab - 1] = True  # only the last token, in the last (partial) word
    allowed[2, 31::32] = True  # bit 31, the sign bit of each word
    bitmask = pack(allowed)
    assert (bitmask[0, : vocab // 32] == -1).all()
    np.testing.assert_array_equal(
        np.asarray(_apply(jnp.asarray(logits), jnp.asarray(bitmask))), reference(logits, bitmask)
    )


def test_padded_vocabulary_never_yields_a_padding_id():
    """Logits wider than the tokenizer (vocabulary padding under TP): the grammar's mask covers the
    tokenizer's ids only; the padding ids stay out even where their logits are the largest."""
    vocab, padded_vocab, num_rows = 70, 128, 6
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((num_rows, padded_vocab)).astype(np.float32)
    logits[:, vocab:] = 50.0  # padding rows of the LM head would win every argmax
    allowed = rng.random((num_rows, vocab)) < 0.5
    grammar_bitmask = pack(allowed)  # [R, ceil(70 / 32) = 3]
    fitted = fit_bitmask(grammar_bitmask, num_rows + 2, padded_vocab)  # two padding rows
    assert fitted.shape == (num_rows + 2, padded_vocab // 32)
    assert (fitted[num_rows:] == -1).all() and (fitted[:num_rows, 3:] == 0).all()
    masked = np.asarray(_apply(jnp.asarray(logits), jnp.asarray(fitted[:num_rows])))
    expected = np.where(allowed, logits[:, :vocab], -np.inf)
    np.testing.assert_array_equal(masked[:, :vocab], expected)
    assert np.isneginf(masked[:, vocab:]).all()
    # Through the sampler, greedy and random: every token allowed, none a padding id.
    for temperature in (0.0, 1.0):
        st = make_tensors(num_rows, temperature=temperature, bitmask=fitted[:num_rows])
        token_ids = np.asarray(_sample(jnp.asarray(logits), st, with_logprobs=False).token_ids)
        assert (token_ids < vocab).all() and allowed[np.arange(num_rows), token_ids].all()


def test_a_row_no_grammar_constrains_keeps_the_logits_past_the_grammars_vocabulary():
    """Logits wider than the grammar's vocabulary (Qwen's config has 151936 ids, its tokenizer 151669):
    an unconstrained row beside a grammar row keeps every logit, so its logprobs are a step's without
    grammars (batch invariance), while the grammar row (and its drafts' positions) never get them."""
    vocab, padded_vocab = 70, 128
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.standard_normal((2, padded_vocab)).astype(np.float32))
    allowed = np.ones((2, vocab), bool)
    allowed[1, :10] = False  # row 1 is under a grammar
    grammar_bitmask = pack(allowed)
    grammar_bitmask[0] = -1  # the manager's unconstrained row: every bit of every word
    fitted = fit_bitmask(grammar_bitmask, 2, padded_vocab)
    assert (fitted[0] == -1).all() and (fitted[1, 3:] == 0).all()
    st = make_tensors(2)
    plain = _sample(logits, st, with_logprobs=True)
    masked = _sample(
        logits, dataclasses.replace(st, allowed_token_bitmask=jnp.asarray(fitted)), with_logprobs=True
    )
    np.testing.assert_array_equal(np.asarray(masked.logprobs)[0], np.asarray(plain.logprobs)[0])
    per_position = fit_bitmask(np.stack([grammar_bitmask] * 3, axis=1), 2, padded_vocab)  # [N, P, W]
    assert (per_position[0] == -1).all() and (per_position[1, :, 3:] == 0).all()


def test_unconstrained_rows_are_untouched_and_logprobs_follow_the_mask():
    """An all-ones row changes nothing (greedy ids and logprobs equal the unmasked sampler's); a
    constrained row's logprobs are those of the masked distribution, so the sampled token ranks 1."""
    vocab, num_rows = 96, 4
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal((num_rows, vocab)).astype(np.float32))
    allowed = np.ones((num_rows, vocab), bool)
    allowed[3] = False
    allowed[3, [5, 17, 90]] = True
    st = make_tensors(num_rows)
    masked_st = dataclasses.replace(st, allowed_token_bitmask=jnp.asarray(pack(allowed)))
    plain = _sample(logits, st, with_logprobs=True)
    masked = _sample(logits, masked_st, with_logprobs=True)
    np.testing.assert_array_equal(np.asarray(masked.token_ids)[:3], np.asarray(plain.token_ids)[:3])
    np.testing.assert_array_equal(np.asarray(masked.logprobs)[:3], np.asarray(plain.logprobs)[:3])
    row = np.asarray(logits[3])
    assert int(masked.token_ids[3]) == [5, 17, 90][int(np.argmax(row[[5, 17, 90]]))]
    assert int(masked.sampled_rank[3]) == 1
    kept = row[[5, 17, 90]]
    expected = -np.log(np.exp(kept - kept.max()).sum())  # the best kept token, renormalized
    np.testing.assert_allclose(float(masked.logprobs[3, 0]), expected, rtol=1e-5)


def test_mask_keeps_the_logits_vocab_sharding_elementwise():
    """The mask is a select over [R, V] like mask_padded_vocab: both compose in one jitted function."""
    vocab, padded_vocab = 40, 64
    logits = jnp.ones((2, padded_vocab), jnp.float32)
    allowed = np.zeros((2, vocab), bool)
    allowed[:, 3] = True
    fitted = jnp.asarray(fit_bitmask(pack(allowed), 2, padded_vocab))
    out = jax.jit(lambda x, b: apply_token_bitmask(mask_padded_vocab(x, vocab), b))(logits, fitted)
    assert np.isfinite(np.asarray(out)).sum() == 2
