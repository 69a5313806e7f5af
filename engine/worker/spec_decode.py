"""Verification of speculative drafts on the device: target logits at k + 1 positions per request, then
rejection sampling that keeps the target distribution exactly.

A request with d drafts computes its last token and the drafts in one forward; position j (0..d) gives
the target distribution p_j of the token after draft j - 1. Greedy rows accept draft j while it equals
argmax p_j and then emit argmax at the first mismatch (or the bonus argmax p_d): the argmax chain, token
for token. Sampled rows accept draft j with probability min(1, p_j(x) / q_j(x)) (the n-gram proposer is
deterministic, so q is one-hot and this is p_j(x)); at the first rejection they draw from the residual
max(0, p_j - q_j), normalized; when all d are accepted, the bonus token is drawn from p_d. The emitted
tokens are then distributed exactly as p (Leviathan et al., 2023; Chen et al., 2023).

Randomness is keyed like the sampler's: position j of a row uses fold_in(key(seed), token_index + j), so
a seeded request is reproducible, and the bonus draw is the sampler's own draw (a row without drafts
samples exactly the token `sample` would). The accept test and the residual draw fold one more tag in.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.kernels.invariant import invariant_softmax
from xlaserve.sampling_params import DEFAULT_MAX_LOGPROBS
from xlaserve.worker.sampler import (
    _GREEDY_EPS,
    SamplingTensors,
    _draw,
    _filter,
    apply_penalties,
    apply_token_bitmask,
    logprobs_if,
)

_ACCEPT_TAG = 1
_RESIDUAL_TAG = 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecInputs:
    """A verification step's extra inputs (host arrays; K = num_speculative_tokens)."""

    verify_indices: np.ndarray  # [R, K + 1] int32: the flat-batch token whose logits give position j
    draft_ids: np.ndarray  # [R, K] int32: the drafts (0 past num_drafts)
    num_drafts: np.ndarray  # [R] int32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyOutput:
    token_ids: jax.Array  # [R] int32: the token after the accepted drafts (a correction or the bonus)
    num_accepted: jax.Array  # [R] int32
    logprob_token_ids: jax.Array | None  # [R, K + 1, 1 + max_logprobs]: emitted token first, then top-n
    logprobs: jax.Array | None  # [R, K + 1, 1 + max_logprobs]
    sampled_rank: jax.Array | None  # [R, K + 1]


def build_spec_inputs(scheduled, num_seqs: int, num_spec_tokens: int) -> SpecInputs:
    """Where each request's k + 1 verified positions sit in the flat batch, and its drafts. Positions
    past a request's drafts repeat its last one (their results are never read)."""
    verify_indices = np.zeros((num_seqs, num_spec_tokens + 1), np.int32)
    draft_ids = np.zeros((num_seqs, num_spec_tokens), np.int32)
    num_drafts = np.zeros(num_seqs, np.int32)
    offset = 0
    for row, s in enumerate(scheduled):
        offset += s.num_new_tokens
        drafts = s.spec_token_ids
        first = offset - 1 - len(drafts)  # the request's last real token
        verify_indices[row] = first + np.minimum(np.arange(num_spec_tokens + 1), len(drafts))
        draft_ids[row, : len(drafts)] = drafts
        num_drafts[row] = len(drafts)
    return SpecInputs(verify_indices, draft_ids, num_drafts)


def step_bitmask(grammar_bitmask: np.ndarray | None, num_spec_tokens: int, has_drafts: bool):
    """The grammar's masks as a step takes them: [N, W] for the sampler (a step without drafts; the
    first position of each row), [N, K + 1, W] for the verifier. A mask given for one position only
    ([N, W]) allows every token at the later ones: right only for rows without drafts (the engine's
    structured-output manager gives one mask per position, `grammar_bitmask(scheduled, 1 + K)`)."""
    if grammar_bitmask is None:
        return None
    if not has_drafts:
        return grammar_bitmask[:, 0] if grammar_bitmask.ndim == 3 else grammar_bitmask
    if grammar_bitmask.ndim == 3:
        if grammar_bitmask.shape[1] != num_spec_tokens + 1:
            raise ValueError(
                f"grammar_bitmask has {grammar_bitmask.shape[1]} positions per row; verifying "
                f"{num_spec_tokens} drafts needs {num_spec_tokens + 1}"
            )
        return grammar_bitmask
    num_rows, width = grammar_bitmask.shape
    per_position = np.full((num_rows, num_spec_tokens + 1, width), -1, np.int32)
    per_position[:, 0] = grammar_bitmask
    return per_position


def _per_position(st: SamplingTensors, draft_ids: jax.Array) -> SamplingTensors:
    """Each row's sampling tensors repeated over its K + 1 positions ([R] -> [R * (K + 1)]): position j
    samples output token token_index + j, after drafts 0..j-1 (counted by the penalties)."""
    num_rows, num_spec = draft_ids.shape
    k1 = num_spec + 1
    rep = lambda x: None if x is None else jnp.repeat(x, k1, axis=0)  # noqa: E731
    token_index = (st.token_index[:, None] + jnp.arange(k1, dtype=jnp.int32)).reshape(-1)
    counts = None
    if st.output_counts is not None:
        onehot = jax.nn.one_hot(draft_ids, st.output_counts.shape[-1], dtype=jnp.int32)  # [R, K, V]
        before = jnp.concatenate([jnp.zeros_like(onehot[:, :1]), jnp.cumsum(onehot, axis=1)], axis=1)
        counts = (st.output_counts[:, None] + before).reshape(num_rows * k1, -1)
    bitmask = st.allowed_token_bitmask
    if bitmask is not None:  # [R, K + 1, W]: position j's mask, after drafts 0..j-1 (`step_bitmask`)
        bitmask = bitmask.reshape(num_rows * k1, -1)
    return SamplingTensors(
        rep(st.temperature),
        rep(st.top_k),
        rep(st.top_p),
        rep(st.min_p),
        rep(st.seeds),
        token_index,
        rep(st.presence_penalty),
        rep(st.frequency_penalty),
        rep(st.repetition_penalty),
        counts,
        rep(st.prompt_mask),
        rep(st.logit_bias),
        bitmask,
    )


def _uniform_and_residual(probs, residual, st: SamplingTensors):
    """Per flat row: a uniform for the accept test and a draw from `residual` (unnormalized)."""

    def one(seed, index, res):
        key = jax.random.fold_in(jax.random.key(seed), index)
        u = jax.random.uniform(jax.random.fold_in(key, _ACCEPT_TAG), (), jnp.float32)
        gumbel = jax.random.gumbel(jax.random.fold_in(key, _RESIDUAL_TAG), res.shape, jnp.float32)
        return u, jnp.argmax(jnp.log(res) + gumbel).astype(jnp.int32)

    return jax.vmap(one)(st.seeds, st.token_index, residual)


def rejection_sample(
    logits: jax.Array,
    st: SamplingTensors,
    draft_ids: jax.Array,
    num_drafts: jax.Array,
    draft_probs: jax.Array | None = None,
    *,
    processed: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array] | tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """logits [R * (K + 1), V] float32 (after the grammar's mask), st per position (`_per_position`),
    draft_ids [R, K], num_drafts [R], draft_probs [R, K, V] (a draft model's q; None: one-hot drafts)
    -> (token after the accepted drafts [R], num_accepted [R], emitted tokens [R, K + 1]), and with
    `processed` the logits p was made of at each position [R * (K + 1), V] (sampler.py's processed
    logprobs: a greedy row's penalized logits)."""
    num_rows, num_spec = draft_ids.shape
    k1 = num_spec + 1
    if st.has_penalties:
        logits = apply_penalties(logits, st)
    is_greedy = (st.temperature < _GREEDY_EPS).reshape(num_rows, k1)[:, 0]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32).reshape(num_rows, k1)
    drafts_k1 = jnp.concatenate([draft_ids, jnp.zeros_like(draft_ids[:, :1])], axis=1)  # [R, K + 1]
    is_draft = jnp.arange(k1)[None, :] < num_drafts[:, None]  # [R, K + 1]

    def random_tokens(logits):
        temperature = jnp.where(st.temperature < _GREEDY_EPS, 1.0, st.temperature)
        filtered = _filter(logits / temperature[:, None], st)
        draws = _draw(filtered, st).reshape(num_rows, k1)  # the sampler's own draw: the bonus token
        probs = invariant_softmax(filtered, axis=-1)  # [R * (K + 1), V]: the target distribution p
        flat_drafts = drafts_k1.reshape(-1)
        p_draft = jnp.take_along_axis(probs, flat_drafts[:, None], axis=-1)[:, 0]
        if draft_probs is None:  # q one-hot on the draft: accept with p(x), residual p without x
            q = jax.nn.one_hot(flat_drafts, probs.shape[-1], dtype=probs.dtype)
            ratio = p_draft
        else:
            q = jnp.concatenate([draft_probs, jnp.zeros_like(draft_probs[:, :1])], axis=1)
            q = q.reshape(num_rows * k1, -1)
            q_draft = jnp.take_along_axis(q, flat_drafts[:, None], axis=-1)[:, 0]
            ratio = p_draft / jnp.maximum(q_draft, 1e-30)
        u, residual_draw = _uniform_and_residual(probs, jnp.maximum(probs - q, 0.0), st)
        accept = (u < ratio).reshape(num_rows, k1)
        return accept, residual_draw.reshape(num_rows, k1), draws, *([filtered] * processed)

    def greedy_tokens(logits):
        return jnp.zeros((num_rows, k1), bool), greedy, greedy, *([logits] * processed)

    accept, residual_draw, draws, *filtered = jax.lax.cond(
        jnp.all(is_greedy), greedy_tokens, random_tokens, logits
    )
    accept = jnp.where(is_greedy[:, None], greedy == drafts_k1, accept) & is_draft
    num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    # At the first rejected draft: argmax (greedy; it differs from the draft) or a residual draw.
    correction = jnp.where(is_greedy[:, None], greedy, residual_draw)
    bonus = jnp.where(is_greedy[:, None], greedy, draws)
    final = jnp.where(is_draft, correction, bonus)
    token_ids = jnp.take_along_axis(final, num_accepted[:, None], axis=1)[:, 0]
    position = jnp.arange(k1)[None, :]
    emitted = jnp.where(position < num_accepted[:, None], drafts_k1, token_ids[:, None])
    if not processed:
        return token_ids, num_accepted, emitted
    row_is_greedy = jnp.repeat(is_greedy, k1)[:, None]
    return token_ids, num_accepted, emitted, jnp.where(row_is_greedy, logits, filtered[0])


def verify(
    logits: jax.Array,
    st: SamplingTensors,
    spec: SpecInputs,
    *,
    with_logprobs: bool | jax.Array,
    draft_probs: jax.Array | None = None,
    logprobs_mode: str = "raw_logprobs",
    max_logprobs: int = DEFAULT_MAX_LOGPROBS,
) -> VerifyOutput:
    """logits [R * (K + 1), V] float32 at the verified positions, st per request ([R]); draft_probs
    [R, K, V]: the q each draft was drawn from (a draft model), None for deterministic (n-gram) drafts.
    `with_logprobs` as sample()'s: a Python bool picks the program, a traced one is a runtime flag
    (zeros when off), so one verify program serves both. `logprobs_mode` and `max_logprobs` as sample()'s."""
    num_rows, num_spec = spec.draft_ids.shape
    st = _per_position(st, spec.draft_ids)
    if st.allowed_token_bitmask is not None:
        logits = apply_token_bitmask(logits, st.allowed_token_bitmask)
    processed = logprobs_mode.startswith("processed")
    token_ids, num_accepted, emitted, *processed_logits = rejection_sample(
        logits, st, spec.draft_ids, spec.num_drafts, draft_probs, processed=processed
    )
    # Logprobs of the raw distribution (after the grammar's mask), or of the processed one, one entry per
    # emitted position.
    logits = processed_logits[0] if processed else logits
    as_logits = logprobs_mode.endswith("logits")
    logprobs = logprobs_if(
        with_logprobs, logits, emitted.reshape(-1), as_logits=as_logits, max_logprobs=max_logprobs
    )
    if logprobs is None:
        return VerifyOutput(token_ids, num_accepted, None, None, None)
    ids, vals, rank = logprobs
    shape = (num_rows, num_spec + 1, 1 + max_logprobs)
    return VerifyOutput(
        token_ids, num_accepted, ids.reshape(shape), vals.reshape(shape), rank.reshape(num_rows, -1)
    )
