"""The attention metadata of one step: an explicit pytree, never a global context."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where the new tokens of a flat ragged batch sit, and where their K/V go.

    The KV cache of all layers is one array ``[num_layers * num_blocks, block_size, kv_heads, dim]``;
    layer ``l`` owns blocks ``[l * num_blocks, (l + 1) * num_blocks)``. Block ids here are those of
    layer 0; a layer adds its offset (a scalar add, no slice of the cache is ever copied).

    Layers of several windows (worker/kv_cache_groups.py `CacheLayout`) keep a table per group and
    share cache slots: the array is ``[num_slots * num_blocks, ...]``, and layer ``l`` reads group
    ``layer_groups[l]``'s table and slot mapping at block offset ``layer_block_offsets[l]``.
    """

    slot_mapping: jax.Array  # [T] int32: block_id * block_size + offset of each new token
    kv_lens: jax.Array  # [R] int32: context length after this step
    block_tables: jax.Array  # [R, max_blocks_per_seq] int32
    query_start_loc: jax.Array  # [R + 1] int32
    num_seqs: jax.Array  # [] int32
    # [R] int32: each sequence's state slot, which a hybrid model's linear-attention layers read and write
    # (core/kv_cache_spec.py StateSpec with its own pool); 0, the null slot, for padding. The host
    # always sends it (None only in metadata built on the device, a draft model's).
    state_slots: jax.Array | None = None
    # [T] int32: how many positions past its own each token also attends to (a bidirectional span:
    # Gemma 3's image tokens see their whole image), for models that ask for it; None otherwise.
    attend_ahead: jax.Array | None = None
    # cos and sin of the rotary angles, [T, 1, rotary_dim // 2] float32 each, when every layer rotates
    # alike: set once per step by the model (models/decoder.py) before its layer scan, never by the host.
    rope: tuple[jax.Array, jax.Array] | None = None
    # Layers of several windows, each window's groups with a block table of their own (None otherwise):
    group_block_tables: jax.Array | None = None  # [G, R, max_blocks_per_seq] int32; group 0's = block_tables
    group_slot_mappings: jax.Array | None = None  # [G, T] int32; group 0's = slot_mapping
    layer_groups: jax.Array | None = None  # [L] int32: each layer's group
    layer_block_offsets: jax.Array | None = None  # [L] int32: each layer's first block (its cache slot's)

    def for_layer(self, layer: jax.Array, num_blocks: int, block_size: int) -> AttentionMetadata:
        """The metadata layer `layer` attends with: its table and slot mapping, offset to its blocks
        (`num_blocks` a layer; unused where the layers' groups give their offsets)."""
        md = self
        if self.layer_block_offsets is None:
            offset = layer * num_blocks
        else:
            group, offset = self.layer_groups[layer], self.layer_block_offsets[layer]
            md = dataclasses.replace(
                self,
                block_tables=self.group_block_tables[group],
                slot_mapping=self.group_slot_mappings[group],
            )
        return dataclasses.replace(
            md,
            slot_mapping=md.slot_mapping + offset * block_size,
            block_tables=md.block_tables + offset,
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The preallocated paged cache of every layer, donated into each step."""

    k: jax.Array  # [num_layers * num_blocks, block_size, num_kv_heads, head_dim]
    v: jax.Array  # [num_layers * num_blocks, block_size, num_kv_heads, head_dim]


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """The shape of a model's paged cache, which the model runner allocates from it.

    The cache is `cache_class(*arrays)`, one array per field of `cache_class` (K and V for
    KVCache; one latent array for MLA), each ``[num_layers * num_blocks, block_size, num_kv_heads,
    head_dim]``. The model class's ``kv_cache_spec(cfg)`` gives it (by default
    ``KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)``: K and V).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    cache_class: type = KVCache
    # The host's bookkeeping kind of these layers (worker/kv_cache_groups.py; a state cache: "state").
    layer_kind: ClassVar[str] = "full_attention"
    # A model that keeps no KV (an encoder: models/encoder.py) has a placeholder cache whose blocks only
    # count the tokens in flight: this many tokens' worth, whatever the memory budget.
    fixed_num_tokens: int | None = None

    @property
    def num_arrays(self) -> int:
        return len(dataclasses.fields(self.cache_class))

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        return (self.num_layers * num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def with_max_num_seqs(self, max_num_seqs: int, num_state_snapshots: int = 0):
        """The spec for an engine running up to `max_num_seqs` requests: the same (its blocks are
        sized by the budget alone; it keeps no state to snapshot)."""
        return self

    def fixed_bytes(self, itemsize: int) -> int:
        """Bytes taken from the budget before blocks are counted: none."""
        return 0

    def bytes_per_block(self, block_size: int, itemsize: int) -> int:
        """Bytes of one block id across all layers and arrays."""
        return self.num_arrays * self.num_layers * block_size * self.num_kv_heads * self.head_dim * itemsize

    def allocate(self, num_blocks: int, block_size: int, zeros) -> object:
        """`zeros(shape)` for each array (the runner passes its placement), wrapped in cache_class."""
        shape = self.shape(num_blocks, block_size)
        return self.cache_class(*(zeros(shape) for _ in range(self.num_arrays)))
