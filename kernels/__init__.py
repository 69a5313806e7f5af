"""Attention ops behind one interface, and the choice of backend by platform."""

from xlaserve.kernels.backend import AttentionBackend, get_attention_backend
from xlaserve.kernels.metadata import AttentionMetadata, KVCache, KVCacheSpec
from xlaserve.kernels.mla import MLACache, mla_paged_attention, write_latent
from xlaserve.kernels.reference import write_kv

# The reference op is `kernels.reference.ragged_paged_attention`, not re-exported here:
# `kernels.ragged_paged_attention` is the Pallas kernel's module, and importing it would rebind the name.

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "KVCache",
    "KVCacheSpec",
    "MLACache",
    "get_attention_backend",
    "mla_paged_attention",
    "write_kv",
    "write_latent",
]
