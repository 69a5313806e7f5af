"""The cache of a hybrid model, whose layers are either attention (paged K/V, by block id) or a
recurrent mixer (a state per request, by slot id): Qwen3.5's Gated DeltaNet, Granite 4.0-H's Mamba2.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from xlaserve.kernels.ssd import copy_slot_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridCache:
    """A hybrid model's cache, donated each step: paged K/V for its attention layers (block ids of the
    shared pool, as `KVCache`), and a state per slot for its linear-attention layers (slot ids of the
    state group's own pool)."""

    k: jax.Array  # [num_attention_layers * num_blocks, block_size, num_kv_heads, head_dim]
    v: jax.Array
    conv: jax.Array  # [num_state_layers * num_slots, 1, K - 1, conv_dim]: the last K - 1 conv inputs
    recurrent: jax.Array  # [num_state_layers * num_slots, *recurrent_shape] float32


@dataclasses.dataclass(frozen=True)
class HybridCacheSpec:
    """The device arrays of a model mixing attention and linear-attention layers (Qwen3.5). The pool's
    block ids size the K/V (`bytes_per_block`); the state slots, one per request that can run, are a
    fixed cost taken from the budget first (`fixed_bytes`). The engine sets `num_state_slots`
    (`with_max_num_seqs`: max_num_seqs + the null slot). The recurrent state stays float32 whatever
    the model's dtype, as Hugging Face keeps it."""

    attention_layers: tuple[int, ...]  # the model's layer ids, in order
    state_layers: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    conv_kernel: int  # K
    conv_dim: int
    recurrent_shape: tuple[
        int, int, int
    ]  # one layer's state: Gated DeltaNet's [Hv, Dk, Dv], Mamba2's [H, P, N]
    num_state_slots: int = 0
    num_state_snapshots: int = 0  # of the slots, those for prefix-cache snapshots
    cache_class: type = HybridCache
    fixed_num_tokens: int | None = None
    layer_kind = "hybrid"  # the host's bookkeeping kind (worker/kv_cache_groups.py)

    @property
    def num_layers(self) -> int:
        return len(self.attention_layers) + len(self.state_layers)

    @property
    def num_arrays(self) -> int:
        return 4

    def with_max_num_seqs(self, max_num_seqs: int, num_state_snapshots: int = 0) -> HybridCacheSpec:
        """A state slot per request that can run, the null slot, and `num_state_snapshots` slots for
        the prefix cache's snapshots."""
        return dataclasses.replace(
            self,
            num_state_slots=max_num_seqs + 1 + num_state_snapshots,
            num_state_snapshots=num_state_snapshots,
        )

    def for_layers(self, layers: range) -> HybridCacheSpec:
        """The spec of a pipeline stage holding the layers `layers` (maybe none of one kind): the same
        slots and block ids, each array holding those layers' rows only."""
        return dataclasses.replace(
            self,
            attention_layers=tuple(i for i in self.attention_layers if i in layers),
            state_layers=tuple(i for i in self.state_layers if i in layers),
        )

    def copy_state_slots(self, cache: HybridCache, src: jax.Array, dst: jax.Array) -> HybridCache:
        """Every state layer's conv inputs and recurrent state of slot src[i] written to slot dst[i]
        (prefix-cache snapshots); the K/V untouched."""
        num_layers = len(self.state_layers)
        return dataclasses.replace(
            cache,
            conv=copy_slot_rows(cache.conv, num_layers, src, dst),
            recurrent=copy_slot_rows(cache.recurrent, num_layers, src, dst),
        )

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """The K (and V) array's."""
        return (len(self.attention_layers) * num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        rows = len(self.state_layers) * self.num_state_slots
        return (
            (rows, 1, self.conv_kernel - 1, self.conv_dim),
            (rows, *self.recurrent_shape),
        )

    def bytes_per_block(self, block_size: int, itemsize: int) -> int:
        """Bytes of one block id: K and V of every attention layer."""
        return 2 * len(self.attention_layers) * block_size * self.num_kv_heads * self.head_dim * itemsize

    def fixed_bytes(self, itemsize: int) -> int:
        """Bytes of the state slots, whatever the number of blocks."""
        conv, recurrent = self.state_shapes()
        return math.prod(conv) * itemsize + math.prod(recurrent) * 4

    def allocate(self, num_blocks: int, block_size: int, zeros) -> HybridCache:
        if self.num_state_slots < 2:
            raise ValueError(
                f"num_state_slots must be >= 2 (slot 0 is the null slot), got {self.num_state_slots}"
            )
        conv, recurrent = self.state_shapes()
        kv = self.shape(num_blocks, block_size)
        return HybridCache(
            zeros(kv),
            zeros(kv),
            zeros(conv, kind="conv_state"),
            zeros(recurrent, jnp.float32, kind="recurrent_state"),
        )
