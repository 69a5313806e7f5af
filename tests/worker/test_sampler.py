"""`sample` and `prompt_logprobs` against numpy: greedy, seeded draws, filters, penalties, logprobs.

Filters and penalties follow vLLM's definitions; the empirical distribution of many seeded draws
(one row per draw, all in one call) is compared with the filtered softmax.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.sampling_params import DEFAULT_MAX_LOGPROBS as MAX_LOGPROBS
from xlaserve.worker.sampler import SamplingTensors, argmax, prompt_logprobs, sample

NUM_ROWS, VOCAB = 16, 64

_sample = jax.jit(sample, static_argnames=("with_logprobs",))
_prompt_logprobs = jax.jit(prompt_logprobs)


def make_tensors(num_rows: int, vocab: int, *, penalties: bool = False, **fields) -> SamplingTensors:
    """All rows greedy and unfiltered unless `fields` (per-row arrays or scalars) say otherwise."""
    values = {
        "temperature": np.zeros(num_rows, np.float32),
        "top_k": np.zeros(num_rows, np.int32),
        "top_p": np.ones(num_rows, np.float32),
        "min_p": np.zeros(num_rows, np.float32),
        "seeds": np.arange(num_rows, dtype=np.uint32),
        "token_index": np.zeros(num_rows, np.int32),
    }
    if penalties:
        values.update(
            presence_penalty=np.zeros(num_rows, np.float32),
            frequency_penalty=np.zeros(num_rows, np.float32),
            repetition_penalty=np.ones(num_rows, np.float32),
            output_counts=np.zeros((num_rows, vocab), np.int32),
            prompt_mask=np.zeros((num_rows, vocab), bool),
            logit_bias=np.zeros((num_rows, vocab), np.float32),
        )
    for name, value in fields.items():
        values[name] = np.broadcast_to(np.asarray(value, values[name].dtype), values[name].shape).copy()
    return SamplingTensors(**{k: jnp.asarray(v) for k, v in values.items()})


def draw(logits, st, *, with_logprobs=False):
    out = _sample(jnp.asarray(logits, jnp.float32), st, with_logprobs=with_logprobs)
    return out if with_logprobs else np.asarray(out.token_ids)


@pytest.fixture(scope="module")
def logits() -> np.ndarray:  # [NUM_ROWS, VOCAB], no ties
    return (np.random.default_rng(0).standard_normal((NUM_ROWS, VOCAB)) * 2).astype(np.float32)


# -- greedy ----------------------------------------------------------------------------------------


def test_two_pass_argmax_is_numpys_first_index():
    x = np.random.default_rng(1).integers(-3, 4, (8, 50)).astype(np.float32)  # many ties
    x[1] = -np.inf  # every token banned: index 0, as np.argmax
    x[2, [5, 9]] = np.inf
    np.testing.assert_array_equal(np.asarray(jax.jit(argmax)(x)), np.argmax(x, axis=-1))


def test_the_sampler_has_no_variadic_argmax_reduce(logits):
    """XLA's CPU argmax (one (value, index) reduce) cost ~10x a max and a min over [64, 49152]
    logits; the sampler's greedy and random draws use the two-pass `argmax`."""
    st = make_tensors(NUM_ROWS, VOCAB, temperature=np.linspace(0, 1, NUM_ROWS))
    for with_logprobs in (False, True):
        jaxpr = str(jax.make_jaxpr(lambda x: sample(x, st, with_logprobs=with_logprobs))(logits))
        assert "argmax" not in jaxpr


def test_all_greedy_is_argmax(logits):
    token_ids = draw(logits, make_tensors(NUM_ROWS, VOCAB))
    np.testing.assert_array_equal(token_ids, logits.argmax(-1))
    assert token_ids.dtype == np.int32


@pytest.mark.parametrize("temperature", [0.3, 1.0, 7.0])
def test_top_k_1_is_greedy_at_any_temperature(logits, temperature):
    rng = np.random.default_rng(1)
    st = make_tensors(
        NUM_ROWS,
        VOCAB,
        temperature=temperature,
        top_k=1,
        seeds=rng.integers(0, 2**32, NUM_ROWS),
        token_index=rng.integers(0, 1000, NUM_ROWS),
    )
    np.testing.assert_array_equal(draw(logits, st), logits.argmax(-1))


def test_mixed_rows_keep_greedy_rows_exact(logits):
    is_greedy = np.arange(NUM_ROWS) % 3 == 0
    # Flat logits make the random rows disagree with argmax often, so the branch is really taken.
    flat = logits / 20
    st = make_tensors(
        NUM_ROWS, VOCAB, temperature=np.where(is_greedy, 0.0, 1.0), top_k=np.where(is_greedy, 0, 40)
    )
    token_ids = draw(flat, st)
    np.testing.assert_array_equal(token_ids[is_greedy], flat.argmax(-1)[is_greedy])
    assert (token_ids[~is_greedy] != flat.argmax(-1)[~is_greedy]).any()


# -- seeding ---------------------------------------------------------------------------------------


def test_seeded_token_is_independent_of_batch_and_row(logits):
    """Each request's token depends on (seed, token_index, its logits) only."""
    rng = np.random.default_rng(2)
    flat = logits / 10  # many plausible tokens
    seeds = rng.integers(0, 2**32, NUM_ROWS)
    index = rng.integers(0, 50, NUM_ROWS)
    alone = make_tensors(NUM_ROWS, VOCAB, temperature=1.0, seeds=seeds, token_index=index)
    expected = draw(flat, alone)

    # Every row moves, and the other rows change: some greedy, some filtered (the sort branch).
    perm = rng.permutation(NUM_ROWS)
    subject = perm < NUM_ROWS // 2  # rows of the new batch that carry the original requests
    other_logits = rng.standard_normal((NUM_ROWS, VOCAB)).astype(np.float32)
    mixed = make_tensors(
        NUM_ROWS,
        VOCAB,
        temperature=np.where(subject, 1.0, rng.choice([0.0, 0.5, 2.0], NUM_ROWS)),
        top_k=np.where(subject, 0, rng.choice([0, 5, 1], NUM_ROWS)),
        top_p=np.where(subject, 1.0, rng.choice([1.0, 0.5], NUM_ROWS)),
        min_p=np.where(subject, 0.0, rng.choice([0.0, 0.2], NUM_ROWS)),
        seeds=np.where(subject, seeds[perm % NUM_ROWS], rng.integers(0, 2**32, NUM_ROWS)),
        token_index=np.where(subject, index[perm % NUM_ROWS], rng.integers(0, 50, NUM_ROWS)),
    )
    token_ids = draw(np.where(subject[:, None], flat[perm % NUM_ROWS], other_logits), mixed)
    np.testing.assert_array_equal(token_ids[subject], expected[perm[subject]])
    # A different seed or token index is a different key: the draws are not all the same again.
    shifted = make_tensors(NUM_ROWS, VOCAB, temperature=1.0, seeds=seeds, token_index=index + 1)
    assert (draw(flat, shifted) != expected).sum() >= NUM_ROWS // 2


def test_token_index_changes_the_draw():
    """One request (one seed) over its token indices, uniform logits: the draws vary like fresh ones."""
    uniform = np.zeros((NUM_ROWS, VOCAB), np.float32)
    st = make_tensors(NUM_ROWS, VOCAB, temperature=1.0, seeds=1234, token_index=np.arange(NUM_ROWS))
    token_ids = draw(uniform, st)
    assert len(set(token_ids.tolist())) >= NUM_ROWS // 2
    # Same index, different seeds: varies too; same seed and index: identical.
    st_seeds = make_tensors(NUM_ROWS, VOCAB, temperature=1.0, seeds=np.arange(NUM_ROWS) + 7, token_index=3)
    assert len(set(draw(uniform, st_seeds).tolist())) >= NUM_ROWS // 2
    st_same = make_tensors(NUM_ROWS, VOCAB, temperature=1.0, seeds=1234, token_index=5)
    assert len(set(draw(uniform, st_same).tolist())) == 1


# -- the distribution of draws ---------------------------------------------------------------------


def filtered_probs(logits, temperature, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """vLLM's order in float64: temperature -> min-p -> top-k -> top-p (on the renormalized rest)."""
    z = np.asarray(logits, np.float64) / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    keep = probs >= min_p * probs.max()
    order = np.argsort(-z)
    if top_k > 0:
        keep[order[top_k:]] = False
    kept = np.where(keep, probs, 0.0)
    kept /= kept.sum()
    sorted_probs = kept[order]
    mass_before = np.cumsum(sorted_probs) - sorted_probs
    # The set must not hinge on rounding: no boundary within 1e-3 of top_p.
    assert not np.any(np.abs(mass_before[sorted_probs > 0] - top_p) < 1e-3)
    keep[order[mass_before >= top_p]] = False
    kept = np.where(keep, probs, 0.0)
    return kept / kept.sum()


DISTRIBUTION_VOCAB = 8
DISTRIBUTION_LOGITS = np.array([2.0, -0.3, 1.1, 0.5, -3.0, 1.6, 0.0, -1.2], np.float32)
FILTERS = [  # (temperature, top_k, top_p, min_p)
    (1.0, 0, 1.0, 0.0),
    (0.7, 3, 1.0, 0.0),
    (1.5, 0, 0.8, 0.0),
    (1.0, 0, 1.0, 0.1),
    (1.3, 5, 0.9, 0.05),
    (2.0, 10, 0.75, 0.0),  # top_k above the vocabulary size: no effect
]
DRAWS_PER_FILTER = 4000


def test_empirical_distribution_matches_filtered_softmax():
    num_rows = len(FILTERS) * DRAWS_PER_FILTER
    temperature, top_k, top_p, min_p = (
        np.repeat(np.array(column), DRAWS_PER_FILTER) for column in zip(*FILTERS)
    )
    st = make_tensors(
        num_rows,
        DISTRIBUTION_VOCAB,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seeds=np.random.default_rng(3).integers(0, 2**32, num_rows),
        token_index=np.arange(num_rows) % 97,
    )
    token_ids = draw(np.broadcast_to(DISTRIBUTION_LOGITS, (num_rows, DISTRIBUTION_VOCAB)), st)
    for i, params in enumerate(FILTERS):
        expected = filtered_probs(DISTRIBUTION_LOGITS, *params)
        counts = np.bincount(
            token_ids[i * DRAWS_PER_FILTER : (i + 1) * DRAWS_PER_FILTER], minlength=DISTRIBUTION_VOCAB
        )
        freq = counts / DRAWS_PER_FILTER
        assert counts[expected == 0].sum() == 0, f"{params}: excluded tokens drawn: {counts} vs {expected}"
        stderr = np.sqrt(expected * (1 - expected) / DRAWS_PER_FILTER)
        assert np.all(np.abs(freq - expected) <= 4.5 * stderr + 1e-9), f"{params}: {freq} vs {expected}"
        assert (expected > 0).sum() >= 2, "each filter should leave a real choice"


# -- penalties and bias ----------------------------------------------------------------------------


def penalized(logits, counts, prompt_mask, presence, frequency, repetition, bias) -> np.ndarray:
    """vLLM: the logit bias, then repetition over prompt and output tokens, then frequency and presence
    over the output."""
    z = np.asarray(logits, np.float64) + bias
    seen = prompt_mask | (counts > 0)
    rep = repetition[:, None]
    z = np.where(seen, np.where(z > 0, z / rep, z * rep), z)
    z -= frequency[:, None] * counts
    z -= presence[:, None] * (counts > 0)
    return z


@pytest.fixture(scope="module")
def penalty_case(logits):
    rng = np.random.default_rng(4)
    counts = rng.integers(0, 4, (NUM_ROWS, VOCAB)) * (rng.random((NUM_ROWS, VOCAB)) < 0.3)
    prompt_mask = rng.random((NUM_ROWS, VOCAB)) < 0.3
    # The top tokens are seen, so that the penalties decide the argmax.
    top = np.argsort(-logits, axis=-1)[:, :3]
    np.put_along_axis(prompt_mask, top, True, axis=-1)
    np.put_along_axis(counts, top[:, :2], 2, axis=-1)
    fields = {
        "presence_penalty": rng.choice([0.0, 0.5, 1.5, -0.5], NUM_ROWS),
        "frequency_penalty": rng.choice([0.0, 0.3, 1.0, -0.2], NUM_ROWS),
        "repetition_penalty": rng.choice([1.0, 1.3, 2.0, 0.8], NUM_ROWS),
        "output_counts": counts,
        "prompt_mask": prompt_mask,
        "logit_bias": np.zeros((NUM_ROWS, VOCAB)),
    }
    fields["presence_penalty"][:4] = [1.5, 0.0, 0.0, 0.0]  # each penalty alone, then all at once
    fields["frequency_penalty"][:4] = [0.0, 1.0, 0.0, 0.0]
    fields["repetition_penalty"][:4] = [1.0, 1.0, 2.0, 1.0]
    return fields


def test_penalties_before_greedy_argmax(logits, penalty_case):
    st = make_tensors(NUM_ROWS, VOCAB, penalties=True, **penalty_case)
    expected = penalized(logits, **_penalty_args(penalty_case))
    token_ids = draw(logits, st)
    np.testing.assert_array_equal(token_ids, expected.argmax(-1))
    # The case is not vacuous: penalties move the argmax in most rows.
    assert (expected.argmax(-1) != logits.argmax(-1)).sum() >= NUM_ROWS // 2
    # Row 3 has no penalty at all: it is the plain argmax.
    assert token_ids[3] == logits[3].argmax()


def _penalty_args(case):
    return {
        "counts": case["output_counts"],
        "prompt_mask": case["prompt_mask"],
        "presence": case["presence_penalty"],
        "frequency": case["frequency_penalty"],
        "repetition": case["repetition_penalty"],
        "bias": case["logit_bias"],
    }


def test_logit_bias_comes_before_the_penalties(logits, penalty_case):
    """A bias on a seen token is scaled by the repetition penalty with the logit (vLLM's order): the
    penalized logits (processed_logits) and the greedy token are those of bias-then-penalties."""
    rng = np.random.default_rng(8)
    bias = np.zeros((NUM_ROWS, VOCAB), np.float32)
    seen = np.argsort(-logits, axis=-1)[:, :3]  # seen in the prompt (penalty_case), so penalized
    np.put_along_axis(bias, seen, rng.choice([-4.0, 3.0, 6.0], (NUM_ROWS, 3)), axis=-1)
    case = dict(penalty_case, repetition_penalty=rng.choice([1.5, 2.0, 3.0], NUM_ROWS), logit_bias=bias)
    st = make_tensors(NUM_ROWS, VOCAB, penalties=True, **case)
    out = jax.jit(partial(sample, with_logprobs=True, logprobs_mode="processed_logits"))(
        jnp.asarray(logits), st
    )
    expected = penalized(logits, **_penalty_args(case))
    np.testing.assert_array_equal(np.asarray(out.token_ids), expected.argmax(-1))
    np.testing.assert_allclose(
        np.asarray(out.logprobs)[:, 1:], -np.sort(-expected, -1)[:, :MAX_LOGPROBS], rtol=1e-5, atol=1e-5
    )
    # Not vacuous: the bias added after the penalties would pick other tokens in some rows.
    after = penalized(logits, **_penalty_args(dict(case, logit_bias=np.zeros_like(bias)))) + bias
    assert (after.argmax(-1) != expected.argmax(-1)).sum() >= 2


def test_logit_bias_comes_before_the_penalties_on_bfloat16_logits(logits, penalty_case):
    """The same order from a bfloat16 model's logits (a head that leaves its accumulator's float32 is
    the usual path, above): the bias and penalties run in float32 on the bfloat16 values, so the result
    is vLLM's `(l + b)` then penalties in float64 on those values, to float32's rounding (bfloat16's
    would be ~100x coarser)."""
    rng = np.random.default_rng(9)
    bias = np.zeros((NUM_ROWS, VOCAB), np.float32)
    seen = np.argsort(-logits, axis=-1)[:, :3]
    np.put_along_axis(bias, seen, rng.choice([-4.0, 3.0, 6.0], (NUM_ROWS, 3)), axis=-1)
    case = dict(penalty_case, repetition_penalty=rng.choice([1.5, 2.0, 3.0], NUM_ROWS), logit_bias=bias)
    st = make_tensors(NUM_ROWS, VOCAB, penalties=True, **case)
    logits_bf16 = jnp.asarray(logits, jnp.bfloat16)
    out = jax.jit(partial(sample, with_logprobs=True, logprobs_mode="processed_logits"))(logits_bf16, st)
    expected = penalized(np.asarray(logits_bf16, np.float64), **_penalty_args(case))
    top2 = -np.sort(-expected, -1)[:, :2]
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3  # no near-tie for float32 to break otherwise
    np.testing.assert_array_equal(np.asarray(out.token_ids), expected.argmax(-1))
    assert out.logprobs.dtype == jnp.float32
    np.testing.assert_allclose(
        np.asarray(out.logprobs)[:, 1:], -np.sort(-expected, -1)[:, :MAX_LOGPROBS], rtol=1e-6, atol=1e-5
    )
    after = penalized(np.asarray(logits_bf16, np.float64), **_penalty_args(dict(case, logit_bias=0 * bias)))
    assert ((after + bias).argmax(-1) != expected.argmax(-1)).sum() >= 2


def test_logit_bias_minus_inf_bans_a_token(logits, penalty_case):
    """min_tokens keeps EOS out with a -inf bias: neither greedy nor random rows may produce it."""
    peaked = logits.copy()
    eos = peaked.argmax(-1)
    peaked[np.arange(NUM_ROWS), eos] += 6.0  # the banned token would win almost every draw
    bias = np.zeros((NUM_ROWS, VOCAB), np.float32)
    bias[np.arange(NUM_ROWS), eos] = -np.inf
    no_penalty = dict(penalty_case, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)
    greedy = make_tensors(NUM_ROWS, VOCAB, penalties=True, **dict(no_penalty, logit_bias=bias))
    second = np.where(np.arange(VOCAB)[None] == eos[:, None], -np.inf, peaked).argmax(-1)
    np.testing.assert_array_equal(draw(peaked, greedy), second)
    for token_index in range(8):
        random_rows = make_tensors(
            NUM_ROWS,
            VOCAB,
            penalties=True,
            **dict(no_penalty, logit_bias=bias),
            temperature=np.linspace(0.5, 3.0, NUM_ROWS),
            top_p=np.where(np.arange(NUM_ROWS) % 2, 1.0, 0.95),
            token_index=token_index,
        )
        assert not np.any(draw(peaked, random_rows) == eos)


# -- logprobs --------------------------------------------------------------------------------------


def log_softmax(logits) -> np.ndarray:
    z = np.asarray(logits, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def check_logprobs(raw_logits, token_ids, ids, vals, ranks, max_logprobs=MAX_LOGPROBS):
    """Token first with its logprob and 1-based rank, then the top `max_logprobs` in order."""
    ids, vals, ranks = np.asarray(ids), np.asarray(vals), np.asarray(ranks)
    expected = log_softmax(raw_logits)
    rows = np.arange(len(token_ids))
    assert ids.shape == vals.shape == (len(token_ids), 1 + max_logprobs)
    np.testing.assert_array_equal(ids[:, 0], token_ids)
    np.testing.assert_allclose(vals[:, 0], expected[rows, token_ids], rtol=1e-5, atol=1e-5)
    expected_rank = 1 + (expected > expected[rows, token_ids][:, None]).sum(-1)
    np.testing.assert_array_equal(ranks, expected_rank)
    top = np.argsort(-expected, axis=-1)[:, :max_logprobs]
    np.testing.assert_array_equal(ids[:, 1:], top)
    np.testing.assert_allclose(vals[:, 1:], np.take_along_axis(expected, top, -1), rtol=1e-5, atol=1e-5)


def test_logprobs_of_sampled_tokens(logits):
    rng = np.random.default_rng(5)
    st = make_tensors(
        NUM_ROWS,
        VOCAB,
        temperature=np.where(np.arange(NUM_ROWS) < 4, 0.0, 1.5),
        top_k=rng.choice([0, 30], NUM_ROWS),
        seeds=rng.integers(0, 2**32, NUM_ROWS),
    )
    out = draw(logits / 3, st, with_logprobs=True)
    token_ids = np.asarray(out.token_ids)
    assert (token_ids != (logits / 3).argmax(-1)).any()  # some ranks > 1 are checked
    check_logprobs(logits / 3, token_ids, out.logprob_token_ids, out.logprobs, out.sampled_rank)


def test_logprobs_are_of_the_raw_logits_under_penalties(logits, penalty_case):
    st = make_tensors(NUM_ROWS, VOCAB, penalties=True, **penalty_case)
    out = draw(logits, st, with_logprobs=True)
    token_ids = np.asarray(out.token_ids)
    np.testing.assert_array_equal(token_ids, penalized(logits, **_penalty_args(penalty_case)).argmax(-1))
    check_logprobs(logits, token_ids, out.logprob_token_ids, out.logprobs, out.sampled_rank)


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_modes(logits, penalty_case, mode):
    """vLLM's --logprobs-mode: raw_logits are the logits themselves; processed_* are of the distribution
    each token was drawn from (penalties, temperature, min-p, top-k, top-p; -inf outside it), a greedy
    row's its penalized logits: the sampled token first, then the top ones in order, ranks over them."""
    rng = np.random.default_rng(6)
    temperature = np.where(np.arange(NUM_ROWS) < 4, 0.0, rng.choice([0.5, 1.0, 1.7], NUM_ROWS))
    top_k, min_p = rng.choice([0, 5, 12], NUM_ROWS), rng.choice([0.0, 0.2], NUM_ROWS)
    st = make_tensors(
        NUM_ROWS, VOCAB, penalties=True, temperature=temperature, top_k=top_k, min_p=min_p,
        seeds=rng.integers(0, 2**32, NUM_ROWS), **penalty_case,
    )  # fmt: skip
    out = jax.jit(partial(sample, with_logprobs=True, logprobs_mode=mode))(jnp.asarray(logits), st)
    z = penalized(logits, **_penalty_args(penalty_case))
    if mode == "raw_logits":
        expected = np.asarray(logits, np.float64)
    else:
        expected = z.copy()
        for row in range(4, NUM_ROWS):
            tempered = z[row] / temperature[row]
            probs = np.exp(tempered - tempered.max())
            kept = probs >= min_p[row] * probs.max()
            kept[np.argsort(-tempered)[top_k[row] or VOCAB :]] = False
            expected[row] = np.where(kept, tempered, -np.inf)
        if mode == "processed_logprobs":
            expected = np.stack(
                [np.where(np.isinf(e), -np.inf, e - np.log(np.exp(e[~np.isinf(e)]).sum())) for e in expected]
            )
    token_ids, ids, vals = (
        np.asarray(out.token_ids),
        np.asarray(out.logprob_token_ids),
        np.asarray(out.logprobs),
    )
    rows = np.arange(NUM_ROWS)
    assert np.isfinite(expected[rows, token_ids]).all() and (token_ids[4:] != z[4:].argmax(-1)).any()
    np.testing.assert_allclose(vals[:, 0], expected[rows, token_ids], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(
        np.asarray(out.sampled_rank), 1 + (expected > expected[rows, token_ids][:, None]).sum(-1)
    )
    top = np.take_along_axis(expected, ids[:, 1:], -1)  # the top entries, in order (past the kept: -inf)
    np.testing.assert_allclose(vals[:, 1:], top, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.sort(top, -1)[:, ::-1], np.sort(expected, -1)[:, ::-1][:, :MAX_LOGPROBS])


def test_prompt_logprobs(logits):
    targets = np.random.default_rng(6).integers(0, VOCAB, NUM_ROWS).astype(np.int32)
    ids, vals, ranks = _prompt_logprobs(jnp.asarray(logits), jnp.asarray(targets))
    check_logprobs(logits, targets, ids, vals, ranks)


def test_max_logprobs_is_the_width(logits):
    """--max-logprobs is the top-k's static width: at 5, the default width's first 5 entries (and the
    sampled token's) bit for bit, prompt logprobs too; at the whole vocabulary (-1), every token in
    order, as a float64 log-softmax has them."""
    st = make_tensors(NUM_ROWS, VOCAB, temperature=1.0, seeds=np.arange(NUM_ROWS) * 7919)
    targets = jnp.asarray(np.random.default_rng(6).integers(0, VOCAB, NUM_ROWS), jnp.int32)
    default = draw(logits, st, with_logprobs=True)  # the module's programs (compiled by the tests above)
    default_prompt = _prompt_logprobs(jnp.asarray(logits), targets)
    run = jax.jit(sample, static_argnames=("with_logprobs", "max_logprobs"))
    five = run(jnp.asarray(logits), st, with_logprobs=True, max_logprobs=5)
    five_prompt = jax.jit(partial(prompt_logprobs, max_logprobs=5))(jnp.asarray(logits), targets)
    pairs = [(five.logprob_token_ids, default.logprob_token_ids), (five.logprobs, default.logprobs)]
    for got, expected in [*pairs, *zip(five_prompt[:2], default_prompt[:2])]:
        assert got.shape[1] == 1 + 5
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected)[:, : 1 + 5])
    np.testing.assert_array_equal(five.token_ids, default.token_ids)
    everything = run(jnp.asarray(logits), st, with_logprobs=True, max_logprobs=VOCAB)
    lp = (everything.logprob_token_ids, everything.logprobs, everything.sampled_rank)
    check_logprobs(logits, np.asarray(default.token_ids), *lp, max_logprobs=VOCAB)


@pytest.mark.parametrize("vocab", [257, 49152])  # a tiny Llama's (helpers/tp_run.py), SmolLM2's
def test_whole_vocabulary_logprobs_are_a_rows_own_bits(vocab):
    """logprobs=-1: a row's entries (ids in rank order, values) are the same bits alone and among
    16, its log-softmax summed in the row's own order (XLA's own rounds a lone row of 257 otherwise), its
    ties (bfloat16 logits have many) broken by id whatever the batch."""
    rows = np.random.default_rng(8).standard_normal((NUM_ROWS, vocab)) * 3
    rows = jnp.asarray(rows, jnp.bfloat16).astype(jnp.float32)
    run = jax.jit(partial(sample, with_logprobs=True, max_logprobs=vocab))
    crowd = run(rows, make_tensors(NUM_ROWS, vocab))
    for row in range(NUM_ROWS):
        alone = run(rows[row : row + 1], make_tensors(1, vocab))
        for got, expected in [
            (alone.logprob_token_ids, crowd.logprob_token_ids),
            (alone.logprobs, crowd.logprobs),
        ]:
            np.testing.assert_array_equal(np.asarray(got)[0], np.asarray(expected)[row], f"row {row}")
    ids, vals = np.asarray(alone.logprob_token_ids)[0, 1:], np.asarray(alone.logprobs)[0, 1:]
    tied = vals[1:] == vals[:-1]
    assert tied.sum() > 10 and (ids[1:][tied] > ids[:-1][tied]).all()


@pytest.mark.parametrize("seed", [0, 2**32 - 1])
def test_seed_extremes(logits, seed):
    """Seeds span uint32 (the engine masks sampling_seed to 32 bits)."""
    st = make_tensors(NUM_ROWS, VOCAB, temperature=1.0, seeds=seed, token_index=np.arange(NUM_ROWS))
    first, again = draw(logits, st), draw(logits, st)
    np.testing.assert_array_equal(first, again)
    assert ((first >= 0) & (first < VOCAB)).all()
