"""Sampling on device, every per-request parameter vectorized over the rows of the batch.

Order (as vLLM): the grammar's token mask -> logit bias, then penalties -> temperature -> min-p ->
top-k -> top-p -> a draw. Each row draws with its own key, fold_in(key(seed), index of the token in
the request), so a seeded request samples the same tokens whatever else shares the batch.

Logprobs, as vLLM's --logprobs-mode says (ModelConfig.logprobs_mode): by default those of the raw distribution
(before penalties and temperature, after the grammar's mask); `processed_*` those of the distribution
the token was drawn from (penalties, temperature, min-p, top-k, top-p applied: -inf outside it; a
greedy row's: its penalized logits), what an RL trainer's importance ratios need; `*_logits` the
logits themselves instead of their log-softmax. Prompt logprobs are always raw.

Every row returns the top `max_logprobs` (vLLM's --max-logprobs, resolved against the vocabulary) and the
host keeps the first n a request asks for: the width is static, so one program serves every request.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from xlaserve.kernels.invariant import invariant_log_softmax, invariant_softmax
from xlaserve.sampling_params import DEFAULT_MAX_LOGPROBS

_GREEDY_EPS = 1e-5
BITS_PER_WORD = 32  # a token bitmask packs 32 tokens into each int32 word


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    temperature: jax.Array  # [R] f32; 0 = greedy
    top_k: jax.Array  # [R] int32; 0 = off
    top_p: jax.Array  # [R] f32; 1 = off
    min_p: jax.Array  # [R] f32; 0 = off
    seeds: jax.Array  # [R] uint32
    token_index: jax.Array  # [R] int32: index of the token being sampled within its request
    # The dense slow path, present only when some row needs it (a separate compiled variant):
    presence_penalty: jax.Array | None = None  # [R] f32
    frequency_penalty: jax.Array | None = None  # [R] f32
    repetition_penalty: jax.Array | None = None  # [R] f32
    output_counts: jax.Array | None = None  # [R, V] int32: occurrences in the output so far
    prompt_mask: jax.Array | None = None  # [R, V] bool: token occurs in the prompt
    logit_bias: jax.Array | None = None  # [R, V] f32: -inf bans a token (min_tokens keeps EOS out)
    # Structured outputs, present only when some row samples under a grammar (another variant: as a
    # runtime flag, a lax.cond around the [R, V] logits copied them and slowed every step):
    allowed_token_bitmask: jax.Array | None = None  # [R, ceil(V / 32)] int32: bit i of word w = token 32w+i

    @property
    def has_penalties(self) -> bool:
        return self.output_counts is not None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    token_ids: jax.Array  # [R] int32
    logprob_token_ids: jax.Array | None  # [R, 1 + max_logprobs]: sampled token first, then top-n
    logprobs: jax.Array | None  # [R, 1 + max_logprobs]
    sampled_rank: jax.Array | None  # [R] int32, 1-based rank of the sampled token


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Tokens whose bit is 0 to -inf. logits [R, V] f32, bitmask [R, W] int32 with 32 * W >= V (the
    bits past V are ignored) -> [R, V]. Static shapes: unpacked with shifts, no gather."""
    num_rows, vocab = logits.shape
    shifts = jnp.arange(BITS_PER_WORD, dtype=jnp.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [R, W, 32]: word w, bit i -> token 32 * w + i
    allowed = bits.reshape(num_rows, -1)[:, :vocab] != 0  # [R, V]
    return jnp.where(allowed, logits, -jnp.inf)


def apply_penalties(logits: jax.Array, st: SamplingTensors) -> jax.Array:  # [R, V]
    """The logit bias (bans included), then the penalties on the biased logits, as vLLM orders them:
    the repetition penalty scales a biased logit, so the order changes the value, not only bans."""
    logits = logits + st.logit_bias
    counts = st.output_counts.astype(jnp.float32)
    seen = st.prompt_mask | (st.output_counts > 0)
    rep = st.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - st.frequency_penalty[:, None] * counts
    return logits - st.presence_penalty[:, None] * (st.output_counts > 0)


def _filter(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """Mask (to -inf) what min-p, top-k and top-p exclude. logits: [R, V], already tempered."""
    vocab = logits.shape[-1]
    probs = invariant_softmax(logits, axis=-1)
    logits = jnp.where(probs < st.min_p[:, None] * probs.max(axis=-1, keepdims=True), -jnp.inf, logits)

    def top_k_top_p(logits):
        sorted_desc = -jnp.sort(-logits, axis=-1)  # [R, V]
        k = jnp.where(st.top_k > 0, jnp.minimum(st.top_k, vocab), vocab)
        kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
        sorted_desc = jnp.where(sorted_desc < kth, -jnp.inf, sorted_desc)
        sorted_probs = invariant_softmax(sorted_desc, axis=-1)
        mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        # The smallest prefix whose mass reaches top_p; top_p = 1 keeps all (float32 sums reach 1 early).
        keep = (mass_before < st.top_p[:, None]) | (st.top_p[:, None] >= 1.0)
        cutoff = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
        return jnp.where(logits < jnp.maximum(cutoff, kth), -jnp.inf, logits)

    # Sorting the vocabulary is the expensive part: skip it when no row asks for top-k/top-p.
    needs_sort = jnp.any(st.top_k > 0) | jnp.any(st.top_p < 1.0)
    return jax.lax.cond(needs_sort, top_k_top_p, lambda x: x, logits)


def argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (the first index of the max), as int32, in two plain reductions:
    XLA's CPU backend runs argmax as one variadic (value, index) reduce that does not vectorize,
    ~10x slower over [64, 49152] logits here than a max and a min (engine/PERFORMANCE.md). A NaN
    row gives the last index instead of the NaN's."""
    ids = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    first = jnp.min(jnp.where(x == x.max(axis=-1, keepdims=True), ids, x.shape[-1] - 1), axis=-1)
    return first.astype(jnp.int32)


def _draw(logits: jax.Array, st: SamplingTensors) -> jax.Array:  # [R] int32
    def one(seed, index, row):
        key = jax.random.fold_in(jax.random.key(seed), index)
        return argmax(row + jax.random.gumbel(key, row.shape, jnp.float32))

    return jax.vmap(one)(st.seeds, st.token_index, logits).astype(jnp.int32)


def sample(
    logits: jax.Array,
    st: SamplingTensors,
    *,
    with_logprobs: bool | jax.Array,
    logprobs_mode: str = "raw_logprobs",
    max_logprobs: int = DEFAULT_MAX_LOGPROBS,
) -> SamplerOutput:
    """logits: [R, V] float32 -> SamplerOutput; its logprobs as `logprobs_mode` says (static), the top
    `max_logprobs` (static, <= V) beside the sampled token's.

    `with_logprobs` as a Python bool picks the program (False: no logprob outputs); as a traced bool
    it is a runtime flag, so one program serves both (the logprob outputs are zeros when it is off;
    the cond's outputs are small, so it costs nothing when off).
    Warm-up compiles every sampler program per request bucket, so each static variant costs start-up
    time (~0.6-1 s of compile each on 2 CPU cores); the runner uses the runtime flag."""
    if st.allowed_token_bitmask is not None:
        logits = apply_token_bitmask(logits, st.allowed_token_bitmask)
    raw = logits
    if st.has_penalties:
        logits = apply_penalties(logits, st)
    is_greedy = st.temperature < _GREEDY_EPS
    greedy_ids = argmax(logits)

    def random_ids(logits):
        tempered = logits / jnp.where(is_greedy, 1.0, st.temperature)[:, None]
        filtered = _filter(tempered, st)
        return jnp.where(is_greedy, greedy_ids, _draw(filtered, st)), filtered

    all_greedy = jnp.all(is_greedy)
    if logprobs_mode.startswith("processed"):  # the drawn-from logits leave the branch too
        token_ids, filtered = jax.lax.cond(all_greedy, lambda x: (greedy_ids, x), random_ids, logits)
        # A greedy row's distribution is its penalized logits, in any batch (no temperature, no filter).
        logits = jnp.where(is_greedy[:, None], logits, filtered)
    else:
        token_ids = jax.lax.cond(all_greedy, lambda _: greedy_ids, lambda x: random_ids(x)[0], logits)
        logits = raw
    as_logits = logprobs_mode.endswith("logits")
    logprobs = logprobs_if(with_logprobs, logits, token_ids, as_logits=as_logits, max_logprobs=max_logprobs)
    return SamplerOutput(token_ids, *(logprobs or (None, None, None)))


def logprobs_if(
    with_logprobs: bool | jax.Array,
    logits: jax.Array,
    token_ids: jax.Array,
    *,
    as_logits: bool = False,
    max_logprobs: int = DEFAULT_MAX_LOGPROBS,
):
    """_token_logprobs(logits, token_ids) as the caller's `with_logprobs` asks: a Python bool picks the
    program (None when off); a traced one is a runtime flag (a lax.cond, zeros when off). The sampler
    and speculative verification both run it. `as_logits`: the logits' own values, not log-softmax's."""
    token_logprobs = functools.partial(_token_logprobs, as_logits=as_logits, max_logprobs=max_logprobs)
    if isinstance(with_logprobs, bool):
        return token_logprobs(logits, token_ids) if with_logprobs else None
    no_logprobs = functools.partial(_no_token_logprobs, max_logprobs=max_logprobs)
    return jax.lax.cond(with_logprobs, token_logprobs, no_logprobs, logits, token_ids)


def _token_logprobs(
    logits: jax.Array,
    token_ids: jax.Array,
    *,
    as_logits: bool = False,
    max_logprobs: int = DEFAULT_MAX_LOGPROBS,
):
    """The sampled token's logprob (or logit), then the top `max_logprobs`: (ids [R, 1 + max_logprobs],
    vals, rank [R])."""
    logprobs = logits if as_logits else invariant_log_softmax(logits, axis=-1)
    top_vals, top_ids = jax.lax.top_k(logprobs, max_logprobs)
    sampled_lp = jnp.take_along_axis(logprobs, token_ids[:, None], axis=-1)
    rank = 1 + jnp.sum(logprobs > sampled_lp, axis=-1).astype(jnp.int32)
    ids = jnp.concatenate([token_ids[:, None], top_ids.astype(jnp.int32)], axis=-1)
    vals = jnp.concatenate([sampled_lp, top_vals], axis=-1)
    return ids, vals, rank


def _no_token_logprobs(raw: jax.Array, token_ids: jax.Array, *, max_logprobs: int):
    num_rows = raw.shape[0]
    zeros = jnp.zeros((num_rows, 1 + max_logprobs), jnp.int32)
    return zeros, zeros.astype(jnp.float32), jnp.zeros(num_rows, jnp.int32)


def prompt_logprobs(logits: jax.Array, target_ids: jax.Array, max_logprobs: int = DEFAULT_MAX_LOGPROBS):
    """Logprobs of each position's next prompt token. logits [T, V], target_ids [T] -> like sample()."""
    return _token_logprobs(logits, target_ids, max_logprobs=max_logprobs)
