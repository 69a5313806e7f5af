"""Speculative decoding's draft-model proposer: a second, smaller model beside the runner's, with its own
paged KV cache, proposing k tokens per request on the device at the end of every step.

The draft cache rides the target's block ids: the same block tables and slot mapping index it, only its
arrays are shaped by the draft's layers, KV heads and head size. Every step the draft first runs the
step's whole flat batch (the same ids, positions and slots as the target), so every position the target
computes, the draft computes too, in the same step. That is the prefix-caching rule: a block the prefix
cache holds was filled by some step's flat batch, in both caches at once, so a hit needs no recompute.

Then it proposes, in one `lax.fori_loop` over k iterations of one token per row ([R] rows: a static
shape): the first input is the token the step just emitted (the verification's correction or bonus),
at the position after the accepted drafts; each iteration writes its input's K/V and draws the next
draft from its logits. Those writes land at positions at or after the request's newest token: never in
a block the prefix cache holds (a block is cached once every token in it is known and computed), and the
next step's flat batch rewrites them with the tokens it keeps. Their slots are the scheduler's
lookahead (`num_lookahead_tokens`, allocated when free); a position without a slot writes to the null
block, and the drafts from it on are dropped (-1): a draft is offered only with the q it was drawn from.

Greedy rows draft the argmax. Sampled rows draw from q, the draft's distribution after the request's
temperature, min-p, top-k and top-p, and q stays on the device ([max_num_seqs, K, V]) for the next
step's rejection sampler (accept with min(1, p / q), else draw from max(0, p - q)): the same q the drafts
were drawn from, so the output keeps the target's distribution exactly. A draft is drawn with the
sampler's own Gumbel noise for the index of the token it stands for, fold_in(key(seed), index): the
draw the verifier would make there were it a bonus token. The accept test and the residual draw fold
in tags of their own, so each stays independent of the draft (the rule's premise), and whether an
index gets a draft or a bonus draw never depends on that index's noise. The coupling makes a seeded
request's tokens depend little on how its steps fell: where q = p (a draft that agrees with the target)
every token is the one the sampler without speculation draws, whatever the schedule.
"""

from __future__ import annotations

import dataclasses
import logging
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.config import EngineConfig
from xlaserve.kernels import AttentionMetadata, KVCache
from xlaserve.kernels.dot_rows import traced_probing
from xlaserve.kernels.invariant import invariant_softmax, traced_with
from xlaserve.models.loader import load_checkpoint
from xlaserve.sharding.vocab import mask_padded_vocab
from xlaserve.worker.kv_cache import allocate_kv_cache, bytes_per_block
from xlaserve.worker.model_loader import load_model
from xlaserve.worker.program import Program
from xlaserve.worker.sampler import _GREEDY_EPS, SamplingTensors, _filter, argmax

logger = logging.getLogger(__name__)

# The sampling scalars the draft reads (temperature, top_k, top_p, min_p, seeds, token_index): values
# and dtypes of a padding row, as input_batch.sampling_tensors makes them.
_SCALARS = ((0, np.float32), (0, np.int32), (1, np.float32), (0, np.float32), (0, np.uint32), (0, np.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftInputs:
    """A step's host arrays for the draft model ([R] int32 each)."""

    last_positions: np.ndarray  # position of the row's last known token (its first verified position)
    num_slots: np.ndarray  # positions below this have a slot in the row's blocks; 0: the row proposes nothing
    prob_rows: np.ndarray  # the row of the draft q buffer holding the q of the drafts this row verifies


def _draw_drafts(logits, st: SamplingTensors, token_index, is_greedy):
    """-> (drafts [R], q [R, V]: the distribution each sampled row drew from; zeros for greedy rows)."""
    greedy = argmax(logits)

    def sampled(logits):
        temperature = jnp.where(is_greedy, 1.0, st.temperature)
        filtered = _filter(logits / temperature[:, None], st)

        def one(seed, index, row):  # the sampler's own noise for this index (see the module doc)
            key = jax.random.fold_in(jax.random.key(seed), index)
            return argmax(row + jax.random.gumbel(key, row.shape, jnp.float32))

        draws = jax.vmap(one)(st.seeds, token_index, filtered)
        probs = jnp.where(is_greedy[:, None], 0.0, invariant_softmax(filtered, axis=-1))
        return jnp.where(is_greedy, greedy, draws), probs

    return jax.lax.cond(jnp.all(is_greedy), lambda x: (greedy, jnp.zeros_like(x)), sampled, logits)


def one_token_inputs(md: AttentionMetadata, pos, num_slots, block_size: int) -> tuple:
    """A drafting iteration's (positions [R], metadata): one query per row at position `pos` [R] in the
    row's blocks (the step's block table); a row without a slot there (`num_slots` [R]) reads and writes
    the null block."""
    num_rows = pos.shape[0]
    valid = pos < num_slots
    rows, max_blocks = jnp.arange(num_rows), md.block_tables.shape[1]
    block = md.block_tables[rows, jnp.minimum(pos // block_size, max_blocks - 1)]
    return jnp.where(valid, pos, 0), AttentionMetadata(
        slot_mapping=jnp.where(valid, block * block_size + pos % block_size, 0),
        kv_lens=jnp.where(valid, pos + 1, 1),
        block_tables=jnp.where(valid[:, None], md.block_tables, 0),
        query_start_loc=jnp.arange(num_rows + 1, dtype=jnp.int32),
        num_seqs=jnp.int32(num_rows),
    )


def propose(
    num_spec: int,
    advance,
    compute_logits,
    kv_cache,
    q_buf,  # [S, K, V] float32, S >= R: the q of the last proposals, rows in step order
    tokens,  # [R]: the token each row emitted this step (after its accepted drafts)
    num_accepted,  # [R]
    st: SamplingTensors,  # [R]: the step's scalar sampling parameters
    inputs: DraftInputs,
    state=None,
    first_hidden=None,
):
    """The drafting loop of every drafter: k drafts per row, one token per row an iteration, each drawn
    from `compute_logits(hidden)` [R, V] (the padded vocabulary masked) and recorded with its q.
    `advance(pos, state, tokens, kv_cache) -> (hidden [R, D], state, kv_cache)` is the drafter's network
    over one token per row: `tokens` sit at `pos` [R] (the emitted token, then each draft in turn);
    `state` is what it carries from one iteration to the next (MTP: its hidden state). `first_hidden`:
    draft 0's hidden state where the step already has it (MTP's, from the flat batch), else `advance`
    makes it from the emitted token. -> (drafts [R, K] int32, -1 from a row's first position without a
    slot; q_buf, kv_cache)."""
    num_rows = tokens.shape[0]
    start = inputs.last_positions + num_accepted + 1  # where each emitted token sits
    token_index = st.token_index + num_accepted + 1  # the output index of the token draft 0 stands for
    is_greedy = st.temperature < _GREEDY_EPS

    def draw(i, hidden, q_buf, drafts):
        next_ids, probs = _draw_drafts(compute_logits(hidden), st, token_index + i, is_greedy)
        # A draft whose input sat where the row has no slot read the null block: cut (-1), never verified.
        valid = start + i < inputs.num_slots
        q_buf = jax.lax.dynamic_update_slice(
            q_buf, jnp.where(valid[:, None], probs, 0.0)[:, None, :], (0, i, 0)
        )
        return q_buf, drafts.at[:, i].set(jnp.where(valid, next_ids, -1)), next_ids

    def body(i, carry):
        kv_cache, state, tokens, drafts, q_buf = carry
        hidden, state, kv_cache = advance(start + i, state, tokens, kv_cache)
        q_buf, drafts, tokens = draw(i, hidden, q_buf, drafts)
        return kv_cache, state, tokens, drafts, q_buf

    drafts = jnp.zeros((num_rows, num_spec), jnp.int32)
    first = 0
    if first_hidden is not None:
        q_buf, drafts, tokens = draw(0, first_hidden, q_buf, drafts)
        first = 1
    carry = (kv_cache, state, tokens, drafts, q_buf)
    kv_cache, _, _, drafts, q_buf = jax.lax.fori_loop(first, num_spec, body, carry)
    return drafts, q_buf, kv_cache


def _draft_step(
    graphdef,
    vocab_size: int,
    block_size: int,
    num_spec: int,
    head_params,
    kv_cache,
    q_buf,  # [S, K, V] float32, S >= R
    input_ids,  # [T]: the step's flat batch, as the target ran it
    positions,  # [T]
    md: AttentionMetadata,
    token_ids,  # [R]: the token each row emitted this step (after its accepted drafts)
    num_accepted,  # [R]
    st: SamplingTensors,  # [R]
    inputs: DraftInputs,
):
    """-> (drafts [R, K] int32, q_buf, kv_cache): `propose` over the draft model."""
    params, head_dv = head_params
    model = nnx.merge(graphdef, params)
    _, kv_cache = model(input_ids, positions, kv_cache, md)  # the draft's cache keeps pace with the target's

    def advance(pos, state, tokens, kv_cache):
        pos, step_md = one_token_inputs(md, pos, inputs.num_slots, block_size)
        hidden, kv_cache = model(tokens, pos, kv_cache, step_md)
        return hidden, state, kv_cache

    def compute_logits(hidden):
        return mask_padded_vocab(model.compute_logits(hidden, head_dv), vocab_size)

    return propose(num_spec, advance, compute_logits, kv_cache, q_buf, token_ids, num_accepted, st, inputs)


class DraftModel:
    """The draft model, its KV cache and its q buffer; the runner calls `prepare` (host) and `step`
    (device) once per step, after the target's sampling or verification."""

    def __init__(self, config: EngineConfig, vocab_size: int, padded_vocab_size: int, devices=None):
        spec = config.speculative
        checkpoint = load_checkpoint(spec.model, skip_tokenizer_init=True, progress=False)
        # The target's dtype, parallelism and attention backend; the draft's own weights as stored.
        draft_config = dataclasses.replace(
            config, model=dataclasses.replace(config.model, model=spec.model, quantization=None)
        )
        model = load_model(draft_config, checkpoint.hf_config, checkpoint.tensors, devices)
        self._check_draft(model, vocab_size, padded_vocab_size)
        logger.info(
            "draft model %s (%s, %d layers) proposes %d tokens per step",
            spec.model,
            model.model_config.architecture,
            model.kv_spec.num_layers,
            spec.num_speculative_tokens,
        )
        self.weight_bytes = model.weight_bytes
        self._set_up(
            config,
            model.kv_spec,
            model.backend,
            model.dtype,
            model.placement,
            (model.params, model.head_dv),
            partial(
                _draft_step, model.graphdef, vocab_size, config.cache.block_size, spec.num_speculative_tokens
            ),
            probe=model.mesh.size == 1,
            kv_heads=model.kv_heads,
        )

    @staticmethod
    def _check_draft(model, vocab_size: int, padded_vocab_size: int) -> None:
        if model.kv_spec.layer_kind != "full_attention":
            raise ValueError(
                f"speculative_config.model: the draft model must have attention layers only (its K/V "
                f"cache rides the target's block table); {model.model_config.architecture} has "
                f"{model.kv_spec.layer_kind!r} layers"
            )
        draft_vocab = model.model_config.vocab_size
        if draft_vocab != vocab_size or model.padded_vocab_size != padded_vocab_size:
            raise ValueError(
                f"speculative_config.model: the draft's vocab_size ({draft_vocab}) must equal the target "
                f"model's ({vocab_size}): a draft model must share the target's tokenizer"
            )

    def _set_up(
        self,
        config: EngineConfig,
        kv_spec,
        backend,
        dtype,
        placement,
        head_params,
        step,
        probe: bool,
        kv_heads: int = 0,
    ):
        """What every drafter keeps: its cache's spec and placement, the weights its step reads first
        (`head_params`) and its step program (`step`, jitted here under the engine's batch invariance).
        `kv_heads`: the network's own KV heads, each moved once when its cache's blocks leave the device
        (worker/kv_offload.py `BlockLayout`; 0: every head its cache holds)."""
        self.num_spec_tokens = config.speculative.num_speculative_tokens
        self.kv_spec, self.backend, self.dtype, self.kv_heads = kv_spec, backend, dtype, kv_heads
        self.placement = placement
        self.head_params = head_params
        self.kv_cache: KVCache | None = None
        self.q_buf: jax.Array | None = None
        self.block_size = config.cache.block_size
        # A Program, as the target's: warm-up loads it from the store of executables or compiles it.
        self._step_fn = Program(
            "draft_step",
            jax.jit(
                traced_with(
                    config.model.batch_invariant,
                    # On one device the drafter's few-row dots take their shapes' probed rows too.
                    traced_probing(probe, step),
                    config.model.batch_invariant_float32,
                ),
                donate_argnames=("kv_cache", "q_buf"),
                compiler_options=config.compilation.compiler_options(),
            ),
            num_fixed_args=self.num_weight_args + 2,  # the weights, the cache and the q buffer
        )
        # Each request's row in the last step that proposed for it: where its q waits in q_buf.
        self._prev_rows: dict[str, int] = {}
        self._no_accepted: dict[int, jax.Array] = {}

    def bytes_per_block(self) -> int:
        """The draft cache's bytes for one block id: its share of the KV memory budget."""
        return bytes_per_block(self.kv_spec, self.block_size, self.backend.cache_dtype(self.dtype))

    def allocate(self, num_blocks: int, max_num_seqs: int, padded_vocab_size: int) -> None:
        self._sizes = (num_blocks, max_num_seqs, padded_vocab_size)  # for `reallocate` on waking
        self.kv_cache = allocate_kv_cache(
            self.kv_spec, num_blocks, self.block_size, self.backend.cache_dtype(self.dtype), self.placement
        )
        shape = (max_num_seqs, self.num_spec_tokens, padded_vocab_size)
        self.q_buf = self.placement.zeros(shape, np.float32, self.placement.replicated)
        logger.info("draft q buffer: %.1f MiB", np.prod(shape) * 4 / 2**20)

    def free_cache(self) -> int:
        """Sleep: delete the draft cache and the q buffer (the prefix cache is reset meanwhile, so no
        request reads what they held); -> the bytes freed."""
        buffers = [*jax.tree.leaves(self.kv_cache), self.q_buf]
        freed = sum(x.nbytes for x in buffers)
        for x in buffers:
            x.delete()
        self.kv_cache = self.q_buf = None
        self._prev_rows.clear()
        return freed

    def reallocate(self) -> None:
        """Waking: `free_cache`'s buffers, zeroed, of the same shapes."""
        self.allocate(*self._sizes)

    @property
    def own_weights(self):
        """The weights this drafter holds itself (sleep level 2 frees them): the draft model's."""
        return self.head_params

    @own_weights.setter
    def own_weights(self, weights) -> None:
        self.head_params = weights

    def follow_target(self, head_params) -> None:
        """The target's weights changed (an update, a wake-up): a draft model reads none of them."""

    def updated_weights(self, named: dict):
        """A target's weight update names none of a draft model's (its own checkpoint): None."""
        return None

    inputs_class = DraftInputs  # the host arrays of a step (`prepare`)

    def empty_inputs(self, num_tokens: int, num_seqs: int) -> DraftInputs:
        """A padding-only step's host arrays (warm-up, HLO inspection): no row proposes."""
        return DraftInputs(*(np.zeros(num_seqs, np.int32) for _ in dataclasses.fields(DraftInputs)))

    def prepare(self, scheduled, num_tokens: int, num_seqs: int, failed: set[str]) -> DraftInputs:
        """Host arrays of one step; remembers which rows propose (their q rows for the next step)."""
        last_positions = np.zeros(num_seqs, np.int32)
        num_slots = np.zeros(num_seqs, np.int32)
        prob_rows = np.zeros(num_seqs, np.int32)
        prev_rows, self._prev_rows = self._prev_rows, {}
        for row, s in enumerate(scheduled):
            rid = s.request_id
            if s.spec_token_ids:
                prob_rows[row] = prev_rows[rid]  # drafts come only from the step just before
            if not s.is_sampling or rid in failed:
                continue
            last_positions[row] = s.num_computed_tokens + s.num_new_tokens - 1 - len(s.spec_token_ids)
            num_slots[row] = len(s.block_ids) * self.block_size
            self._prev_rows[rid] = row
        return DraftInputs(last_positions, num_slots, prob_rows)

    def step(self, batch, hidden, token_ids, num_accepted: jax.Array | None, st: SamplingTensors, inputs):
        """Run the draft over the step's batch (ready for the device) and propose k tokens per row ->
        drafts [R, K] (on the device). `hidden`: the target's final-norm hidden states [T, D] (an MTP
        layer reads them); `num_accepted`: the verifier's, or None (no drafts this step); `st`, `inputs`:
        the step's host arrays."""
        args = self._args(batch, hidden, token_ids, num_accepted, st, inputs)
        drafts, self.q_buf, self.kv_cache = self._step_fn(*args)
        return drafts

    def forward_inputs(self) -> dict:
        """Keyword arguments of the target's forward this drafter needs (EAGLE-3: its `aux_layers`)."""
        return {}

    def verify_args(self, prob_rows: np.ndarray) -> tuple:
        """The verifier's q arguments: the q buffer, and where each row's q is in it ([R])."""
        return (self.q_buf, self.placement.step_inputs(prob_rows))

    def warm_up_step(self, batch, num_seqs: int) -> tuple:
        """Warm-up: the step's program and its arguments for one token bucket (`batch`: an empty one,
        ready), made like those of `step`."""
        st = SamplingTensors(*(np.full(num_seqs, v, dtype) for v, dtype in _SCALARS))
        zeros = self._zeros(num_seqs)
        num_tokens = batch.input_ids.shape[0]
        inputs = self.empty_inputs(num_tokens, num_seqs)
        return self._step_fn, self._args(batch, self._hidden_like(num_tokens), zeros, zeros, st, inputs)

    def _hidden_like(self, num_tokens: int):
        """Warm-up's stand-in for the target's hidden states (None: this drafter does not read them)."""
        return None

    def _zeros(self, num_seqs: int) -> jax.Array:
        """[R] zeros made like the verifier's outputs (committed, replicated): one program for both."""
        if num_seqs not in self._no_accepted:
            self._no_accepted[num_seqs] = self.placement.zeros(
                (num_seqs,), np.int32, self.placement.replicated
            )
        return self._no_accepted[num_seqs]

    def _args(self, batch, hidden, token_ids, num_accepted, st: SamplingTensors, inputs) -> tuple:
        """The step program's arguments: its weights, cache and q buffer, what it reads of the step's
        tokens, their positions and metadata, then each row's emitted token, acceptances and host arrays."""
        ready = self.placement.step_inputs
        scalars = SamplingTensors(st.temperature, st.top_k, st.top_p, st.min_p, st.seeds, st.token_index)
        if num_accepted is None:
            num_accepted = self._zeros(token_ids.shape[0])
        return (
            *self._weights(),
            self.kv_cache,
            self.q_buf,
            self._tokens_read(batch, hidden),
            batch.positions,
            batch.md,
            token_ids,
            num_accepted,
            ready(scalars),
            ready(inputs),
        )

    num_weight_args = 1  # how many `_weights` returns

    def _weights(self) -> tuple:
        """The weights the step program reads: the draft model's."""
        return (self.head_params,)

    def _tokens_read(self, batch, hidden):
        """What the step program reads of the step's tokens: their ids (a draft model runs them again)."""
        return batch.input_ids
