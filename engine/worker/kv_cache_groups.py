"""The host's view of a model's cache: its device spec (kernels) -> the core's KV cache groups.

The model class says what its cache arrays are (`kv_cache_spec`: K and V, MLA's latent, or a state
per slot); the scheduler's bookkeeping needs only each group's kind (core/kv_cache_spec.py). This is
the one place that maps the first onto the second, so neither the runner nor the core branches on a
model's layer kinds, and where what a kind cannot do yet is refused, by the field that asks for it.

Attention layers of several windows (Gemma 2 and 3, gpt-oss: sliding layers beside full ones) form
several groups of equal size (vLLM's hybrid KV cache manager): the layers of each window split into
groups of as many layers as the rarest window has, each group with its own block table over the one
pool. A block id is then a page in each of `num_slots` cache slots (not in every layer), and layer l
reads its group's table at its slot (`CacheLayout`): a sliding group's blocks behind its window go back
to the pool, so a long request holds its full layers' blocks and a window's worth for the others.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from xlaserve.config import EngineConfig
from xlaserve.core.kv_cache_spec import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec, StateSpec
from xlaserve.models.config import TransformerConfig

logger = logging.getLogger(__name__)


def kv_cache_groups(
    kv_spec, model_config: TransformerConfig, config: EngineConfig
) -> tuple[KVCacheGroup, ...]:
    """The groups of the model's layers, of the kinds its cache spec declares. Attention layers that
    all slide by one window form a sliding-window group, whose blocks behind the window go back to
    the pool; layers of several windows form a group per window (`window_groups`), unless a feature
    that moves blocks by one table is on (`_one_table_reason`: then one full-attention group)."""
    block_size = config.cache.block_size
    layers = tuple(range(kv_spec.num_layers))
    if kv_spec.layer_kind == "state":
        _check_state_features(config, has_attention=False)
        return (KVCacheGroup(StateSpec(block_size), layers),)
    if kv_spec.layer_kind == "hybrid":  # attention's blocks first: group 0 is the step's block table
        _check_state_features(config, has_attention=True)
        return (
            KVCacheGroup(FullAttentionSpec(block_size), kv_spec.attention_layers),
            KVCacheGroup(
                StateSpec(
                    block_size,
                    num_slots=kv_spec.num_state_slots,
                    num_snapshot_slots=kv_spec.num_state_snapshots,
                ),
                kv_spec.state_layers,
            ),
        )
    if kv_spec.layer_kind != "full_attention":
        raise ValueError(
            f"kv_cache_spec.layer_kind {kv_spec.layer_kind!r} is not supported: "
            "expected 'full_attention', 'state' or 'hybrid'"
        )
    windows = set(model_config.layer_sliding_windows)
    if windows == {None}:
        return (KVCacheGroup(FullAttentionSpec(block_size), layers),)
    reason = _one_table_reason(config, several_windows=len(windows) > 1)
    if reason is not None:
        logger.info("the KV cache keeps every block of every layer's context: %s", reason)
        return (KVCacheGroup(FullAttentionSpec(block_size), layers),)
    if len(windows) == 1:
        return (KVCacheGroup(SlidingWindowSpec(block_size, sliding_window=windows.pop()), layers),)
    return window_groups(model_config.layer_sliding_windows, block_size)


def window_groups(layer_windows, block_size: int) -> tuple[KVCacheGroup, ...]:
    """Attention layers of several windows (None: full attention) as groups of equal size: each
    window's layers in order, split into groups of as many layers as the rarest window has (the last of
    a window's groups may hold fewer). Full attention's groups first: group 0's table is the step's
    `block_tables`, which readers of the whole context (failure isolation) use."""
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        by_window.setdefault(window, []).append(layer)
    size = min(len(layer_ids) for layer_ids in by_window.values())
    groups = []
    for window in sorted(by_window, key=lambda w: (w is not None, w or 0)):
        spec = (
            FullAttentionSpec(block_size)
            if window is None
            else SlidingWindowSpec(block_size, sliding_window=window)
        )
        layer_ids = by_window[window]
        groups += [
            KVCacheGroup(spec, tuple(layer_ids[start : start + size]))
            for start in range(0, len(layer_ids), size)
        ]
    return tuple(groups)


def _one_table_reason(config: EngineConfig, *, several_windows: bool) -> str | None:
    """Why sliding layers must keep every block, in one table with any full layers (None: they need
    not): features that read or move every block of a request's table (a draft model's layers, which
    may not slide; the host tier and disaggregated prefill, which copy whole prefixes), and, for layers
    of several windows, those that know one table only."""
    parallel, cache = config.parallel, config.cache
    reasons = (
        (
            config.speculative is not None and config.speculative.method == "draft_model",
            "a draft model's layers read the target's table",
        ),
        (bool(cache.kv_offloading_size), "the host tier (kv_offloading_size) copies whole prefixes"),
        (
            cache.kv_transfer_config is not None,
            "disaggregated prefill (kv_transfer_config) sends whole prefixes",
        ),
    )
    if several_windows:
        reasons += (
            (config.scheduler.disable_hybrid_kv_cache_manager, "disable_hybrid_kv_cache_manager is set"),
            (parallel.pipeline_parallel_size > 1, "pipeline stages split the cache by layer"),
            (
                parallel.decode_context_parallel_size > 1,
                "decode context parallel interleaves one table's blocks",
            ),
            (parallel.prefill_context_parallel_size > 1, "prefill context parallel reads one table"),
        )
    return next((reason for applies, reason in reasons if applies), None)


@dataclass(frozen=True)
class CacheLayout:
    """Where each layer's K/V lives when the attention layers form several groups: layer l reads the
    block table of group `layer_groups[l]` at cache slot `layer_slots[l]` (its place in its group). The
    device cache holds `num_slots` slots of every block (kernels/metadata.py `AttentionMetadata`), not
    one per layer."""

    layer_groups: np.ndarray  # [L] int32
    layer_slots: np.ndarray  # [L] int32
    num_groups: int
    num_slots: int

    def layer_block_offsets(self, num_blocks: int) -> np.ndarray:
        """[L] int32: each layer's first block in the cache arrays (its slot's)."""
        return (self.layer_slots * num_blocks).astype(np.int32)


def cache_layout(groups: tuple[KVCacheGroup, ...]) -> CacheLayout | None:
    """The layout of several attention groups' layers (None: at most one attention group, whose
    layers keep a cache slot each, in layer order)."""
    attention = [group for group in groups if not group.spec.holds_state]
    if len(attention) < 2:
        return None
    num_layers = sum(len(group.layer_ids) for group in attention)
    layer_groups = np.zeros(num_layers, np.int32)
    layer_slots = np.zeros(num_layers, np.int32)
    for index, group in enumerate(attention):
        for slot, layer in enumerate(group.layer_ids):
            layer_groups[layer], layer_slots[layer] = index, slot
    num_slots = max(len(group.layer_ids) for group in attention)
    return CacheLayout(layer_groups, layer_slots, len(attention), num_slots)


def num_state_copy_slots(config: EngineConfig) -> int:
    """Slots a hybrid model's state pool keeps beside the live ones: for prefix-cache snapshots and
    speculative decoding's backups (the state entering a step that verifies drafts), max_num_seqs
    when either is on, else none."""
    uses_copies = config.cache.enable_prefix_caching or config.speculative is not None
    return config.scheduler.max_num_seqs if uses_copies else 0


def _check_state_features(config: EngineConfig, *, has_attention: bool) -> None:
    """What a recurrent state cannot serve yet: a draft model's drafts on a model of state layers only
    (the draft's K/V cache follows the target's attention block table: a hybrid's group 0; a state-only
    model has none), a float8 cache (the state is kept in the model's dtype), a host tier (it holds
    blocks, not state snapshots), and disaggregated prefill (blocks only)."""
    if config.speculative is not None and config.speculative.method != "ngram" and not has_attention:
        raise ValueError(
            f"speculative_config: method {config.speculative.method!r} is not supported for models with "
            "only state-space layers (a draft model's K/V cache follows the target's attention blocks, "
            "which such a model has none of); use method 'ngram'"
        )
    if config.cache.kv_cache_dtype != "auto":
        raise ValueError(
            f"kv_cache_dtype={config.cache.kv_cache_dtype!r} is not supported for models with state-space "
            "layers; use kv_cache_dtype='auto'"
        )
    if config.cache.kv_offloading_size:
        raise ValueError(
            "kv_offloading_size: KV offload to host memory is not supported for models with state-space "
            "layers (the host tier holds K/V blocks, not the states' snapshots); leave it unset"
        )
    if config.cache.kv_transfer_config is not None:
        raise ValueError(
            "kv_transfer_config: disaggregated prefill is not supported for models with state-space "
            "layers yet (the prompt's recurrent state would have to travel with its blocks); leave it unset"
        )
