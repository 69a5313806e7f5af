"""The host's view of a model's cache: its device spec (kernels) -> the core's KV cache groups.

The model class says what its cache arrays are (`kv_cache_spec`: K and V, MLA's latent, or a state
per slot); the scheduler's bookkeeping needs only each group's kind (core/kv_cache_spec.py). This is
the one place that maps the first onto the second, so neither the runner nor the core branches on a
model's layer kinds, and where what a kind cannot do yet is refused, by the field that asks for it.
"""

from __future__ import annotations

from xlaserve.config import EngineConfig
from xlaserve.core.kv_cache_spec import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec, StateSpec
from xlaserve.models.config import TransformerConfig


def kv_cache_groups(
    kv_spec, model_config: TransformerConfig, config: EngineConfig
) -> tuple[KVCacheGroup, ...]:
    """One group of every layer, of the kind the model's cache spec declares. Attention layers that
    all slide by one window form a sliding-window group, whose blocks behind the window go back to
    the pool. (Layers of mixed kinds, Gemma's, stay one full-attention group: each kind's block table
    reaching the step is a later change.)"""
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
    # A draft model reads the same block table with layers of its own, which may not slide.
    has_draft_model = config.speculative is not None and config.speculative.method == "draft_model"
    if len(windows) == 1 and None not in windows and not has_draft_model:
        return (KVCacheGroup(SlidingWindowSpec(block_size, sliding_window=windows.pop()), layers),)
    return (KVCacheGroup(FullAttentionSpec(block_size), layers),)


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
