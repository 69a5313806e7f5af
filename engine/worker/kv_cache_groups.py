"""The host's view of a model's cache: its device spec (kernels) -> the core's KV cache groups.

The model class says what its cache arrays are (`kv_cache_spec`: K and V, MLA's latent, or a state
per slot); the scheduler's bookkeeping needs only each group's kind (core/kv_cache_spec.py). This is
the one place that maps the first onto the second, so neither the runner nor the core branches on a
model's layer kinds.
"""

from __future__ import annotations

from xlaserve.core.kv_cache_spec import FullAttentionSpec, KVCacheGroup, StateSpec

# Device spec `layer_kind` -> the core's group spec class.
_GROUP_SPECS = {"full_attention": FullAttentionSpec, "state": StateSpec}


def kv_cache_groups(kv_spec, block_size: int) -> tuple[KVCacheGroup, ...]:
    """One group of every layer, of the kind the model's cache spec declares."""
    try:
        spec_class = _GROUP_SPECS[kv_spec.layer_kind]
    except KeyError:
        raise ValueError(
            f"kv_cache_spec.layer_kind {kv_spec.layer_kind!r} is not supported: expected one of "
            f"{sorted(_GROUP_SPECS)}"
        ) from None
    return (KVCacheGroup(spec_class(block_size), tuple(range(kv_spec.num_layers))),)
