"""Attention ops behind one interface, and the choice of backend by platform."""

from kernels.backend import AttentionBackend, get_attention_backend
from kernels.metadata import AttentionMetadata, KVCache
from kernels.reference import ragged_paged_attention, write_kv

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "KVCache",
    "get_attention_backend",
    "ragged_paged_attention",
    "write_kv",
]
