"""Speculative decoding with the checkpoint's own multi-token prediction layer (`{"method": "mtp"}`,
vLLM's name; models/mtp.py): a drafter like the draft model (worker/draft_model.py: its own K/V cache
on the target's block ids, k drafts per step in one program, q kept for exact rejection), whose network
reads the target's hidden states.

Every step the MTP layer first runs the step's whole flat batch, as the draft model does: at each
position i, the token at i + 1 and the target's hidden state at i. The host knows the token after
every position but a sampling row's last accepted one (`next_ids`); there the token the step just
emitted (the verification's correction or bonus, or a prompt's first output) is written on the device,
at the row's first verified position plus its accepted drafts (`verify_starts`). So each position's
K/V is written from the token that follows it, and the layer's output at that last accepted position
is draft 0 (the token after the emitted one). Positions past it (rejected drafts) are written from
tokens that were not kept; the next step's flat batch starts at the emitted token and rewrites them,
as it does for the draft model. Drafts 1..k-1 come one token per row in a `lax.fori_loop`, the layer
fed its own output in place of the target's hidden state (as vLLM's MTP and EAGLE proposers do).
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
from xlaserve.kernels import AttentionMetadata
from xlaserve.models.mtp import mtp_class
from xlaserve.models.quantization import weight_bytes
from xlaserve.models.registry import get_model_class
from xlaserve.models.weights import load_params
from xlaserve.sharding.layout import lay_out_for_mesh
from xlaserve.sharding.vocab import mask_padded_vocab
from xlaserve.worker.draft_model import DraftInputs, DraftModel, one_token_inputs, propose
from xlaserve.worker.sampler import SamplingTensors

logger = logging.getLogger(__name__)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MTPInputs(DraftInputs):
    """A step's host arrays for the MTP layer: the draft model's, and where each row's tokens are."""

    verify_starts: np.ndarray  # [R] flat index of the row's last known token
    next_ids: np.ndarray  # [T] the token after each flat position, where the host knows it (else 0)


def layer_draft_step(
    target_graphdef,
    mtp_graphdef,
    vocab_size: int,
    block_size: int,
    num_spec: int,
    head_params,
    mtp_params,  # the layer's
    logits_args,  # arrays its `draft_logits` reads besides (EAGLE-3: each draft id's target id)
    kv_cache,
    q_buf,
    hidden,  # [T, D] the target's final-norm hidden states (EAGLE-3: its aux hidden states)
    positions,  # [T]
    md: AttentionMetadata,
    token_ids,  # [R] the token each row emitted this step
    num_accepted,  # [R]
    st: SamplingTensors,
    inputs: MTPInputs,
    # [3, T] an M-RoPE target's positions of the step's tokens, as the image hook placed them for the
    # target's forward (worker/mm_encoder.py); None for any other target.
    mrope=None,
):
    """-> (drafts [R, K] int32, q_buf, kv_cache): `propose` over the drafting layer (an MTP layer, or
    EAGLE-3's network: models/eagle3.py), through its `embed`, `combine`, call and `draft_logits`."""
    params, head_dv = head_params
    target = nnx.merge(target_graphdef, params)
    layer = nnx.merge(mtp_graphdef, mtp_params)
    num_tokens = positions.shape[0]
    proposes = inputs.num_slots > 0
    emitted_at = inputs.verify_starts + num_accepted  # each row's last accepted position, in the batch
    next_ids = inputs.next_ids.at[jnp.where(proposes, emitted_at, num_tokens)].set(token_ids, mode="drop")
    last = jnp.clip(emitted_at, 0, num_tokens - 1)
    flat_md = md if mrope is None else target.mrope_metadata(md, mrope)
    embeds = layer.embed(target, next_ids)
    out, carried, kv_cache = layer(embeds, layer.combine(hidden), positions, kv_cache, flat_md)
    # Draft 0's output, and the hidden state draft 1 reads.
    h, state = out[last], carried[last]

    def advance(pos, state, tokens, kv_cache):  # draft i from draft i - 1 (at `pos`) and its hidden state
        # The layer at a position reads the token after it: K/V at the position before the draft's.
        pos, step_md = one_token_inputs(md, pos - 1, inputs.num_slots, block_size)
        if mrope is not None:
            # Past the prompt every token is text: its three streams are equal, its position shifted by
            # what the images before it changed (the last accepted token's shift, `mrope_positions`).
            shift = mrope[0, last] - positions[last]
            step_md = target.mrope_metadata(step_md, jnp.broadcast_to(pos + shift, (3, pos.shape[0])))
        h, state, kv_cache = layer(layer.embed(target, tokens), state, pos, kv_cache, step_md)
        return h, state, kv_cache

    def compute_logits(h):
        return mask_padded_vocab(layer.draft_logits(target, h, head_dv, *logits_args), vocab_size)

    return propose(
        num_spec,
        advance,
        compute_logits,
        kv_cache,
        q_buf,
        token_ids,
        num_accepted,
        st,
        inputs,
        state=state,
        first_hidden=h,
    )


class MTPDrafter(DraftModel):
    """The target checkpoint's MTP layer as the drafter (module doc); `runner`: the ModelRunner, whose
    model it reads (embedding, LM head, hidden states) and whose checkpoint holds the layer's weights."""

    inputs_class = MTPInputs

    def __init__(self, config: EngineConfig, runner, hf_config: dict, tensors, vocab_size: int):
        target_class = get_model_class(runner.model_config.architecture)
        layer_class = mtp_class(target_class)
        num_layers = 0 if layer_class is None else layer_class.num_layers(hf_config)
        if num_layers == 0:
            raise ValueError(
                f"speculative_config.method 'mtp': {runner.model_config.architecture} has no multi-token "
                "prediction layer here (Qwen3.5, Qwen3.5-MoE and Qwen3-Next checkpoints do: "
                "mtp_num_hidden_layers in config.json; DeepSeek V3 and R1: num_nextn_predict_layers)"
            )
        if num_layers != 1:
            raise ValueError(f"speculative_config.method 'mtp': {num_layers} MTP layers; one is supported")
        cfg = runner.model_config  # the layer is one of the target's attention layers, in its shapes
        dtype, backend, placement = runner.dtype, runner.backend, runner.placement
        self._prefix = layer_class.hf_prefix(cfg)
        # Its KV heads repeated as the target's are under tensor parallelism (sharding/kv_heads.py).
        self._checkpoint_cfg = cfg.replace(num_kv_heads=runner.kv_heads)
        self._tensor_parallel_size = placement.tensor_parallel_size
        self._load = partial(
            load_params,
            layer_class,
            cfg,
            dtype=dtype,
            make_model=lambda: layer_class(cfg, backend, dtype=dtype, rngs=nnx.Rngs(0)),
            place=placement.place_param,
        )
        graphdef, params = self._load(self._layer_tensors(tensors))
        self.mtp_params = params
        self.logits_args = ()  # the layer's `draft_logits` reads the target's head alone
        self.weight_bytes = weight_bytes(params)
        # The runner's image hook where its positions are M-RoPE's: they rotate this layer too.
        images = runner.mm_encoder
        self.images = images if images is not None and images.mrope else None
        logger.info(
            "MTP layer (%s) proposes %d tokens per step", layer_class.__name__, config.num_spec_tokens
        )
        self.hidden_size = cfg.hidden_size
        self._set_up_layer(
            config, runner, layer_class.kv_cache_spec(cfg), graphdef, vocab_size, runner.kv_heads
        )

    def _set_up_layer(
        self, config: EngineConfig, runner, kv_spec, graphdef, vocab_size: int, kv_heads: int
    ) -> None:
        """`_set_up` for a layer drafting over the target's hidden states, on the target's devices and
        dtype, reading its embedding and head (`layer_draft_step`); `kv_heads`: the layer's KV heads in
        its checkpoint (its cache may hold copies of them under tensor parallelism)."""
        self._set_up(
            config,
            kv_spec,
            runner.backend,
            runner.dtype,
            runner.placement,
            runner.head_params,
            partial(
                layer_draft_step,
                runner.graphdef,
                graphdef,
                vocab_size,
                config.cache.block_size,
                config.num_spec_tokens,
            ),
            probe=runner.mesh.size == 1,
            kv_heads=kv_heads,
        )

    @property
    def own_weights(self):
        return self.mtp_params

    @own_weights.setter
    def own_weights(self, weights) -> None:
        self.mtp_params = weights

    def _layer_tensors(self, tensors) -> dict:
        """The layer's tensors of `tensors` (a checkpoint's, an update's), laid out for the mesh as the
        target's are (sharding/layout.py: its KV heads repeated)."""
        layer = {name: t for name, t in tensors.items() if name.startswith(self._prefix)}
        return lay_out_for_mesh(self._checkpoint_cfg, layer, self._tensor_parallel_size)[1]

    def updated_weights(self, named: dict):
        """The layer's weights loaded again from an update (worker/weight_update.py) that holds its
        tensors, every one of them (as a checkpoint load: a missing one is a ValueError naming it), in
        the same shapes and shardings; None where the update names none."""
        tensors = {name: np.asarray(t) for name, t in self._layer_tensors(named).items()}
        if not tensors:
            return None
        try:
            return self._load(tensors)[1]
        except ValueError as e:
            raise ValueError(
                f"weights: the MTP layer's tensors ({self._prefix}*) are updated whole: {e}"
            ) from e

    def follow_target(self, head_params) -> None:
        """The layer reads the target's embedding and LM head: the arrays placed now, not the ones an
        update replaced or a sleep deleted."""
        self.head_params = head_params

    def empty_inputs(self, num_tokens: int, num_seqs: int) -> MTPInputs:
        base = super().empty_inputs(num_tokens, num_seqs)
        return MTPInputs(
            **dataclasses.asdict(base), verify_starts=base.num_slots, next_ids=np.zeros(num_tokens, np.int32)
        )

    def prepare(self, scheduled, num_tokens: int, num_seqs: int, failed: set[str]) -> MTPInputs:
        """The draft model's arrays, and where each row's tokens are in the batch with the token that
        follows each of them."""
        base = super().prepare(scheduled, num_tokens, num_seqs, failed)
        verify_starts = np.zeros(num_seqs, np.int32)
        next_ids = np.zeros(num_tokens, np.int32)
        offset = 0
        for row, s in enumerate(scheduled):
            n, start = s.num_new_tokens, s.num_computed_tokens
            tokens = s.request.all_token_ids
            known = tokens[start + 1 : start + n + 1 - len(s.spec_token_ids)] + s.spec_token_ids
            next_ids[offset : offset + len(known)] = known[:n]
            verify_starts[row] = offset + n - 1 - len(s.spec_token_ids)
            offset += n
        return MTPInputs(**dataclasses.asdict(base), verify_starts=verify_starts, next_ids=next_ids)

    def _hidden_like(self, num_tokens: int):
        return self.placement.zeros((num_tokens, self.hidden_size), self.dtype, self.placement.replicated)

    num_weight_args = 3

    def _weights(self) -> tuple:
        """The target's (embedding and head), the layer's, and the arrays its `draft_logits` reads."""
        return (self.head_params, self.mtp_params, self.logits_args)

    def _tokens_read(self, batch, hidden):
        """The target's hidden states (the layer reads the ids after them: `MTPInputs.next_ids`)."""
        return hidden

    def _args(self, batch, hidden, token_ids, num_accepted, st: SamplingTensors, inputs) -> tuple:
        """`DraftModel._args`, then an M-RoPE target's positions as the image hook placed them for the
        step's forward (None for any other target)."""
        num_tokens = batch.positions.shape[0]
        mrope = None if self.images is None else self.images.step_mrope_placed(num_tokens)
        return (*super()._args(batch, hidden, token_ids, num_accepted, st, inputs), mrope)
