"""Attention backend selection: `--attention-backend auto|reference|pallas|jax-triton`."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import jax

from kernels import reference

logger = logging.getLogger(__name__)

BACKENDS = ("reference", "pallas", "jax-triton")


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    name: str
    attention: Callable  # the ragged_paged_attention signature of kernels/reference.py
    write_kv: Callable
    reason: str


def get_attention_backend(name: str = "auto") -> AttentionBackend:
    """Resolve a backend name; an unavailable backend asked for by name is a clear error."""
    platform = jax.default_backend()
    if name == "auto":
        return AttentionBackend(
            "reference",
            reference.ragged_paged_attention,
            reference.write_kv,
            f"auto on platform {platform!r}: the jnp reference is the only validated backend here",
        )
    if name == "reference":
        return AttentionBackend(
            "reference", reference.ragged_paged_attention, reference.write_kv, "asked for by name"
        )
    if name in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not available in this build; use 'reference'")
    raise ValueError(f"attention_backend must be one of ('auto',) + {BACKENDS}, got {name!r}")
