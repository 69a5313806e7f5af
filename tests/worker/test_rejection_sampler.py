"""Rejection sampling of speculative drafts (worker/spec_decode.py): greedy rows keep the target's argmax
chain; sampled rows keep the target distribution exactly, checked over thousands of seeded draws (the
seeds are fixed, so the statistics are the same on every run: the thresholds cannot flake)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.worker.sampler import SamplingTensors, sample
from xlaserve.worker.spec_decode import SpecInputs, _per_position, build_spec_inputs, rejection_sample, verify

V, K = 6, 2
NUM_DRAWS = 20_000
# Chi-square critical value for 5 degrees of freedom at p = 1e-6: a correct sampler exceeds it once in
# a million seed sets; these seeds are fixed, so the test is deterministic.
CHI2_CRIT_DF5 = 35.9


def tensors(num_rows, temperature=1.0, top_k=0, seeds=None, token_index=None, **extra):
    return SamplingTensors(
        jnp.full(num_rows, temperature, jnp.float32),
        jnp.full(num_rows, top_k, jnp.int32),
        jnp.ones(num_rows, jnp.float32),
        jnp.zeros(num_rows, jnp.float32),
        jnp.arange(num_rows, dtype=jnp.uint32) if seeds is None else seeds,
        jnp.zeros(num_rows, jnp.int32) if token_index is None else token_index,
        **extra,
    )


def target_probs(logits_row, temperature, top_k):
    """The sampler's target distribution in float64: tempered, top-k kept, normalized."""
    x = np.asarray(logits_row, np.float64) / temperature
    if top_k:
        x = np.where(x < np.sort(x)[-top_k], -np.inf, x)
    p = np.exp(x - x.max())
    return p / p.sum()


def chi2(counts, probs):
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token outside the target's support was emitted"
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


# The sampler's and the verifier's programs, one per batch shape as the runner's (called op by op,
# each of their ops compiles on its own).
_sample = jax.jit(sample, static_argnames="with_logprobs")
_verify = jax.jit(verify, static_argnames=("with_logprobs", "logprobs_mode"))


@jax.jit
def _run(logits, st, draft_ids, num_drafts, draft_probs=None):
    return rejection_sample(logits, _per_position(st, draft_ids), draft_ids, num_drafts, draft_probs)


def test_greedy_rows_keep_the_argmax_chain():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, K + 1, V)).astype(np.float32)
    argmax = logits.argmax(-1)
    wrong = (argmax + 1) % V
    draft_ids = np.stack(
        [
            argmax[0, :K],  # all accepted: the bonus argmax follows
            [argmax[1, 0], wrong[1, 1]],  # the second rejected: argmax at position 1
            [wrong[2, 0], argmax[2, 1]],  # the first rejected: nothing after it counts
            [0, 0],  # no drafts: the plain argmax
        ]
    ).astype(np.int32)
    num_drafts = np.array([2, 2, 2, 0], np.int32)
    token, accepted, emitted = _run(
        jnp.asarray(logits.reshape(-1, V)), tensors(4, temperature=0.0), draft_ids, num_drafts
    )
    assert accepted.tolist() == [2, 1, 0, 0]
    assert token.tolist() == [argmax[0, 2], argmax[1, 1], argmax[2, 0], argmax[3, 0]]
    assert np.asarray(emitted)[0].tolist() == argmax[0].tolist()


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 4)])
def test_ngram_drafts_keep_the_target_distribution(temperature, top_k):
    """One-hot drafts (the n-gram proposer): the emitted token at position 0 is distributed as p0, and
    the one at position 1, after the first draft was emitted, as p1."""
    rng = np.random.default_rng(1)
    rows = rng.normal(scale=1.2, size=(K + 1, V)).astype(np.float32)
    p = [target_probs(row, temperature, top_k) for row in rows]
    drafts = np.array([int(np.argsort(p[0])[-2]), int(np.argmax(p[1]))], np.int32)  # likely, not certain
    logits = jnp.asarray(np.tile(rows, (NUM_DRAWS, 1)))
    st = tensors(NUM_DRAWS, temperature=temperature, top_k=top_k)
    draft_ids = np.tile(drafts, (NUM_DRAWS, 1))
    token, accepted, emitted = _run(logits, st, draft_ids, np.full(NUM_DRAWS, K, np.int32))
    emitted, accepted = np.asarray(emitted), np.asarray(accepted)
    first = np.bincount(emitted[:, 0], minlength=V)
    assert chi2(first, p[0]) < CHI2_CRIT_DF5
    # The draft is accepted with probability p0(draft), not always (nor never).
    assert abs((accepted >= 1).mean() - p[0][drafts[0]]) < 0.02
    after_draft = emitted[accepted >= 1, 1]
    assert chi2(np.bincount(after_draft, minlength=V), p[1]) < CHI2_CRIT_DF5
    # Tokens past the accepted drafts are the correction (or bonus) token.
    assert (emitted[np.arange(NUM_DRAWS), accepted] == np.asarray(token)).all()


def test_draft_model_drafts_keep_the_target_distribution():
    """Drafts drawn from a draft model's q: accept with min(1, p/q), else draw from max(0, p - q)."""
    rng = np.random.default_rng(2)
    rows = rng.normal(size=(K + 1, V)).astype(np.float32)
    p0 = target_probs(rows[0], 1.0, 0)
    q = rng.dirichlet(np.ones(V), size=K).astype(np.float32)  # [K, V]
    drafts = np.stack([rng.choice(V, size=NUM_DRAWS, p=q[j] / q[j].sum()) for j in range(K)], 1)
    token, accepted, emitted = _run(
        jnp.asarray(np.tile(rows, (NUM_DRAWS, 1))),
        tensors(NUM_DRAWS),
        drafts.astype(np.int32),
        np.full(NUM_DRAWS, K, np.int32),
        jnp.asarray(np.tile(q, (NUM_DRAWS, 1, 1))),
    )
    assert chi2(np.bincount(np.asarray(emitted)[:, 0], minlength=V), p0) < CHI2_CRIT_DF5
    # The acceptance rate at position 0 is sum(min(p, q)).
    assert abs((np.asarray(accepted) >= 1).mean() - np.minimum(p0, q[0]).sum()) < 0.02


def test_seeded_rows_are_reproducible_and_a_row_without_drafts_samples_like_the_sampler():
    rng = np.random.default_rng(3)
    rows = rng.normal(size=(3 * (K + 1), V)).astype(np.float32)
    seeds = jnp.asarray([7, 7, 9], jnp.uint32)
    token_index = jnp.asarray([5, 5, 5], jnp.int32)
    logits = np.concatenate([rows[: K + 1], rows[: K + 1], rows[K + 1 : 2 * (K + 1)]])
    st = tensors(3, seeds=seeds, token_index=token_index)
    draft_ids = np.array([[1, 2], [1, 2], [0, 0]], np.int32)
    token, accepted, _ = _run(jnp.asarray(logits), st, draft_ids, np.array([2, 2, 0], np.int32))
    assert token[0] == token[1] and accepted[0] == accepted[1]  # same seed and position, other row
    plain = _sample(
        jnp.asarray(logits[2 * (K + 1)][None]),
        tensors(1, seeds=seeds[2:], token_index=token_index[2:]),
        with_logprobs=False,
    )
    assert int(token[2]) == int(plain.token_ids[0])


def test_penalties_count_the_drafts_before_each_position_and_logprobs_follow_the_emitted_tokens():
    """Greedy with a strong repetition penalty: position j's argmax is the sampler's own with the drafts
    before j counted as output; logprobs come one entry per position, emitted token first."""
    rng = np.random.default_rng(4)
    V = 32  # noqa: N806 (wider than top-20 logprobs)
    logits = rng.normal(size=(K + 1, V)).astype(np.float32)
    logits[:, 3] += 3.0  # token 3 leads everywhere, until the penalty counts it
    counts = np.zeros((1, V), np.int32)
    extra = dict(
        presence_penalty=jnp.zeros(1),
        frequency_penalty=jnp.zeros(1),
        repetition_penalty=jnp.full(1, 50.0),
        output_counts=jnp.asarray(counts),
        prompt_mask=jnp.zeros((1, V), bool),
        logit_bias=jnp.zeros((1, V)),
    )
    st = tensors(1, temperature=0.0, **extra)
    spec = SpecInputs(np.zeros((1, K + 1), np.int32), np.array([[3, 3]], np.int32), np.array([2], np.int32))
    out = jax.jit(verify, static_argnames="with_logprobs")(jnp.asarray(logits), st, spec, with_logprobs=True)
    # Position 0 takes 3 (not yet counted); at position 1 the draft 3 is penalized away.
    assert int(out.num_accepted[0]) == 1
    counted = dict(extra, output_counts=jnp.asarray(np.eye(V, dtype=np.int32)[[3]]))
    expected = _sample(jnp.asarray(logits[1:2]), tensors(1, temperature=0.0, **counted), with_logprobs=False)
    assert int(out.token_ids[0]) == int(expected.token_ids[0]) != 3
    ids = np.asarray(out.logprob_token_ids[0])
    assert ids[0, 0] == 3 and ids[1, 0] == int(out.token_ids[0])
    raw = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), -1))
    np.testing.assert_allclose(np.asarray(out.logprobs[0])[:2, 0], [raw[0, 3], raw[1, ids[1, 0]]], rtol=1e-5)
    # The runner's form: one program, logprobs a runtime flag. On: the static program's bits; off: zeros,
    # and the same tokens.
    runtime = jax.jit(verify)
    on, off = (runtime(jnp.asarray(logits), st, spec, with_logprobs=flag) for flag in (True, False))
    for a, b in ((on.logprob_token_ids, out.logprob_token_ids), (on.logprobs, out.logprobs)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(on.sampled_rank), np.asarray(out.sampled_rank))
    assert not np.asarray(off.logprobs).any() and not np.asarray(off.logprob_token_ids).any()
    assert np.asarray(off.token_ids).tolist() == np.asarray(out.token_ids).tolist()
    programs = {
        runtime.lower(jnp.asarray(logits), st, spec, with_logprobs=f).as_text() for f in (True, False)
    }
    assert len(programs) == 1  # the flag does not pick a second program


def test_processed_logprobs_are_of_each_positions_target_distribution():
    """--logprobs-mode processed_logprobs: each emitted position's logprob is of the distribution its
    token was accepted or drawn from (tempered, top-k kept: -inf outside), a greedy row's of its logits."""
    rng = np.random.default_rng(5)
    V = 32  # noqa: N806 (wider than top-20 logprobs)
    logits = rng.normal(scale=2.0, size=(2 * (K + 1), V)).astype(np.float32)
    top = np.argsort(-logits, -1)
    drafts = np.array([top[0, 1], top[1, 0], top[K + 1, 0], top[K + 2, 0]], np.int32).reshape(2, K)
    spec = SpecInputs(np.zeros((2, K + 1), np.int32), drafts, np.array([K, K], np.int32))
    st = SamplingTensors(
        *(jnp.asarray(a) for a in ([0.7, 0.0], [4, 0], [1.0, 1.0], [0.0, 0.0], [3, 4], [0, 0]))
    )
    out = _verify(jnp.asarray(logits), st, spec, with_logprobs=True, logprobs_mode="processed_logprobs")
    raw = _verify(jnp.asarray(logits), st, spec, with_logprobs=True)
    assert np.asarray(out.token_ids).tolist() == np.asarray(raw.token_ids).tolist()  # the same draws
    ids, vals = np.asarray(out.logprob_token_ids), np.asarray(out.logprobs)
    for row, (temperature, top_k) in enumerate([(0.7, 4), (1.0, 0)]):
        for j in range(int(out.num_accepted[row]) + 1):
            with np.errstate(divide="ignore"):  # log(0) outside the top k: -inf, as the engine's
                expected = np.log(target_probs(logits[row * (K + 1) + j], temperature, top_k))
            np.testing.assert_allclose(vals[row, j, 0], expected[ids[row, j, 0]], rtol=1e-5)
            np.testing.assert_allclose(vals[row, j, 1:], np.sort(expected)[::-1][:20], rtol=1e-5)
    assert np.isneginf(vals[0, 0, 5:]).all() and np.isfinite(vals[1, 0]).all()


def test_build_spec_inputs_points_at_each_requests_last_token_and_drafts():
    class S:
        def __init__(self, n, drafts):
            self.num_new_tokens, self.spec_token_ids = n, drafts

    spec = build_spec_inputs([S(5, []), S(3, [8, 9]), S(1, [])], 4, K)
    # Offsets 0-4 (a prefill chunk), 5-7 (last real token 5, drafts at 6 and 7), 8.
    assert spec.verify_indices.tolist() == [[4, 4, 4], [5, 6, 7], [8, 8, 8], [0, 0, 0]]
    assert spec.draft_ids.tolist() == [[0, 0], [8, 9], [0, 0], [0, 0]]
    assert spec.num_drafts.tolist() == [0, 2, 0, 0]


def test_each_verified_position_is_sampled_under_its_own_grammar_mask():
    """A grammar's bitmask per position ([R, K + 1, W]): position j is the mask after drafts 0..j-1. A
    draft its position's mask forbids is never accepted (greedy or sampled), and every emitted token is
    allowed at its position."""

    def pack(*allowed):
        return np.int32(sum(1 << t for t in allowed))

    logits = np.zeros((K + 1, V), np.float32)
    logits[0, [1, 2]] = [3.0, 1.0]  # argmax 1: allowed
    logits[1, [3, 4, 0]] = [5.0, 2.0, 1.0]  # argmax 3: forbidden here; the masked argmax is 4
    logits[2, [2, 5]] = [4.0, 0.5]  # argmax 2: forbidden; only 5 is allowed
    bitmask = np.array([[[pack(1, 2)], [pack(0, 4)], [pack(5)]]], np.int32)  # [1, K + 1, W = 1]
    spec = lambda drafts: SpecInputs(  # noqa: E731
        np.arange(K + 1, dtype=np.int32)[None],
        np.array([drafts], np.int32),
        np.array([len(drafts)], np.int32),
    )
    greedy = tensors(1, temperature=0.0, allowed_token_bitmask=jnp.asarray(bitmask))
    out = _verify(jnp.asarray(logits), greedy, spec([1, 4]), with_logprobs=False)
    assert (int(out.num_accepted[0]), int(out.token_ids[0])) == (2, 5)  # the masked argmax chain
    out = _verify(jnp.asarray(logits), greedy, spec([1, 3]), with_logprobs=False)
    assert (int(out.num_accepted[0]), int(out.token_ids[0])) == (1, 4)  # 3 is the unmasked argmax only
    # Sampled, over many seeds: draft 3 (forbidden at position 1) is never accepted; what is emitted
    # there is 0 or 4, and the bonus after [1, 4] is always 5.
    num_seeds = 500
    seeds = jnp.arange(num_seeds, dtype=jnp.uint32)
    sampled = tensors(
        num_seeds, seeds=seeds, allowed_token_bitmask=jnp.asarray(np.repeat(bitmask, num_seeds, 0))
    )
    many = lambda drafts: SpecInputs(  # noqa: E731
        (np.arange(num_seeds)[:, None] * (K + 1) + np.arange(K + 1)).astype(np.int32),
        np.tile(np.array([drafts], np.int32), (num_seeds, 1)),
        np.full(num_seeds, len(drafts), np.int32),
    )
    tiled = jnp.asarray(np.tile(logits, (num_seeds, 1)))
    out = _verify(tiled, sampled, many([1, 3]), with_logprobs=False)
    accepted, tokens = np.asarray(out.num_accepted), np.asarray(out.token_ids)
    assert accepted.max() <= 1
    assert set(tokens[accepted == 1].tolist()) <= {0, 4} and set(tokens[accepted == 0].tolist()) <= {1, 2}
    out = _verify(tiled, sampled, many([1, 4]), with_logprobs=False)
    accepted, tokens = np.asarray(out.num_accepted), np.asarray(out.token_ids)
    assert set(tokens[accepted == 2].tolist()) == {5} and (accepted == 2).any()
