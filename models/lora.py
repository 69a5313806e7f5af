"""LoRA on the device: the low-rank delta of a projection, for a flat batch whose tokens use different
adapters.

Adapters live in fixed slots (engine/worker/lora_manager.py): per target module and per layer,
A [in, S, r] and B [S, r, out] with S = max_loras, every adapter padded with zeros to the max rank and
its scaling (alpha / r, or alpha / sqrt(r) for rsLoRA) folded into B. Each token carries its slot
(1..S; 0 is the base model, which has no device slot: its one-hot row is all zeros), so one program
serves any mix of adapters, and loading an adapter only writes into its slot: nothing recompiles.

The delta is computed with a one-hot over the slots: x @ A for every slot in one [in, S * r]
matmul, the slots a token does not use zeroed by a mask built once per step, then one [S * r, out]
matmul. It does S times the FLOPs of a per-token gather, but as two dense matmuls it was the fastest
of the three forms measured on CPU (a gathered A[slot] per token, `jax.lax.ragged_dot` over tokens
sorted by slot: engine/PERFORMANCE.md). A step in which no token uses an adapter skips every delta
(`lax.cond` on a flag computed once per step, in the same program: no extra compile).

The adapters belong to the projections: a `Linear` is `Adaptable`, and the decoder binds each layer's
slots to its projections by path inside the layer scan (`bind_adapters`), so no family's layers take
or pass a LoRA argument.

Both dots go through `dtype_ops.matmul`, as the projections do, so a decode step's few rows are padded
as theirs are: with batch invariance on, a token's delta has the same bits alone as among companions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from xlaserve.kernels.dtype_ops import matmul


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRAWeights:
    """The adapter slots of one layer stack ([L, ...] arrays) or of one layer, by the module's path
    inside a decoder layer ("self_attn.q_proj", "mlp.down_proj"). A keeps the slots after the input
    axis, so that x @ A of every slot is one matmul over a free reshape [in, S * r], with no
    transpose in the step."""

    a: dict[str, jax.Array]  # [(L,) in, S, r]
    b: dict[str, jax.Array]  # [(L,) S, r, out], scaling folded in


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotMask:
    """Built once per step, outside the layer scan, and shared by every projection of every layer."""

    columns: jax.Array  # [T, S * r] float32: 1 on the columns of each token's own slot
    active: jax.Array  # [] bool: some token of the step uses an adapter (else every delta is skipped)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRABatch:
    """What the forward needs for LoRA: the slots of every layer stack and each token's slot."""

    stacks: dict[str, LoRAWeights]  # by layer stack name ("layers")
    slot_ids: jax.Array  # [T] int32: 0 = the base model, s = device slot s - 1

    def slot_mask(self) -> SlotMask:
        a = next(iter(next(iter(self.stacks.values())).a.values()))  # [L, in, S, r]
        num_slots, rank = a.shape[-2:]
        # The base model's -1 is out of range: its one-hot row is zeros, so it costs no slot's FLOPs.
        one_hot = jax.nn.one_hot(self.slot_ids - 1, num_slots, dtype=jnp.float32)  # [T, S]
        return SlotMask(jnp.repeat(one_hot, rank, axis=1), jnp.any(self.slot_ids > 0))


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One projection's adapter slots for the step, bound to it inside the layer scan (`bind_adapters`)."""

    a: jax.Array  # [in, S, r]
    b: jax.Array  # [S, r, out], scaling folded in
    slot_mask: SlotMask  # LoRABatch.slot_mask(): one for every projection of every layer

    def __call__(self, y: jax.Array, x: jax.Array) -> jax.Array:
        """y + the delta for x [T, in]; y itself when no token of the step uses an adapter."""
        mask = self.slot_mask
        return jax.lax.cond(
            mask.active, lambda: y + lora_delta(x, self.a, self.b, mask.columns).astype(y.dtype), lambda: y
        )


class Adaptable:
    """A projection that knows its adapters: `adapter` is set for one step by `bind_adapters` (None:
    the base model's program, with nothing added). The families never see LoRA: their layers call the
    projection as they always do, and the decoder binds the adapters to the projections by path."""

    adapter: Adapter | None = None

    def with_adapter(self, y: jax.Array, x: jax.Array) -> jax.Array:
        return y if self.adapter is None else self.adapter(y, x)


def bind_adapters(layer, weights: LoRAWeights, slot_mask: SlotMask) -> None:
    """Give each projection of one decoder layer (a merged nnx module, inside the layer scan) its slots:
    `weights` holds them by the module's path in the layer ("self_attn.q_proj", "mlp.shared_experts.
    up_proj"). A path with no adaptable projection is an error: an adapter would silently not apply."""
    unbound = set(weights.a)
    for path, module in nnx.iter_graph(layer):
        key = ".".join(str(p) for p in path)
        if key in unbound and isinstance(module, Adaptable):
            module.adapter = Adapter(weights.a[key], weights.b[key], slot_mask)
            unbound.discard(key)
    if unbound:
        raise ValueError(f"LoRA slots for {sorted(unbound)}: no such projection in {type(layer).__name__}")


def lora_delta(
    x: jax.Array,  # [T, in]
    a: jax.Array,  # [in, S, r]
    b: jax.Array,  # [S, r, out]
    slot_mask: jax.Array,  # [T, S * r] float32
) -> jax.Array:  # [T, out] float32
    """The one-hot form (the module docstring says why): x @ A of every slot, masked to the token's
    own, @ B of every slot."""
    din, num_slots, rank = a.shape
    xa = matmul(x, a.reshape(din, num_slots * rank).astype(x.dtype), jnp.float32)
    xa = xa * slot_mask  # [T, S * r]
    return matmul(xa.astype(b.dtype), b.reshape(num_slots * rank, -1), jnp.float32)


# The two other forms measured (engine/PERFORMANCE.md), over A as [S, in, r] and each token's device
# slot (0..S-1; these forms need a zero slot for base-model tokens).


def lora_delta_gathered(x, a_sir, b, slot_ids):
    """Per token: x @ A[slot] @ B[slot] (gathers [T, in, r] and [T, r, out])."""
    xa = jnp.einsum("ti,tir->tr", x, a_sir[slot_ids].astype(x.dtype), preferred_element_type=jnp.float32)
    return jnp.einsum("tr,tro->to", xa.astype(b.dtype), b[slot_ids], preferred_element_type=jnp.float32)


def lora_delta_ragged(x, a_sir, b, slot_ids):
    """Tokens sorted by slot, `jax.lax.ragged_dot` over the groups, then unsorted."""
    num_slots = a_sir.shape[0]
    order = jnp.argsort(slot_ids, stable=True)
    group_sizes = jnp.bincount(slot_ids, length=num_slots).astype(jnp.int32)
    xa = jax.lax.ragged_dot(x[order], a_sir.astype(x.dtype), group_sizes, preferred_element_type=jnp.float32)
    y = jax.lax.ragged_dot(xa.astype(b.dtype), b, group_sizes, preferred_element_type=jnp.float32)
    return jnp.zeros_like(y).at[order].set(y)
