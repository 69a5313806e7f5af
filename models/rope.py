"""Rotary position embeddings with the scaling variants Hugging Face configs carry."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def base_inv_freq(head_dim: int, theta: float) -> np.ndarray:  # [head_dim // 2]
    return 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))


def _llama3_inv_freq(inv_freq: np.ndarray, scaling: dict[str, Any]) -> np.ndarray:
    """Llama 3.1: stretch low frequencies by `factor`, keep high ones, blend the band between."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(is_medium, blended, scaled)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> np.ndarray:
    """Static inverse frequencies [head_dim // 2] for default, linear and llama3 scaling."""
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    inv_freq = base_inv_freq(head_dim, theta)
    if rope_type in ("default", "dynamic"):
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported (default, linear, dynamic, llama3)")


def rope_angles(
    positions: jax.Array,  # [T]
    head_dim: int,
    theta: float,
    scaling: dict[str, Any],
    max_position_embeddings: int,
) -> jax.Array:  # [T, head_dim // 2]
    """Rotation angles per token.

    Dynamic NTK scaling follows Hugging Face's decode-time behaviour: a token at position p is
    rotated with the base for a sequence of length p + 1, which is the default base until the
    sequence outgrows max_position_embeddings.
    """
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    pos = positions.astype(jnp.float32)
    if rope_type != "dynamic":
        inv_freq = jnp.asarray(rope_inv_freq(head_dim, theta, scaling), jnp.float32)
        return pos[:, None] * inv_freq[None, :]
    factor = scaling["factor"]
    seq_len = jnp.maximum(pos + 1, max_position_embeddings)
    base = theta * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (head_dim / (head_dim - 2))
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    inv_freq = 1.0 / (base[:, None] ** exponents[None, :])
    return pos[:, None] * inv_freq


def apply_rope(x: jax.Array, angles: jax.Array) -> jax.Array:
    """Rotate halves (the Hugging Face layout). x: [T, H, D]; angles: [T, D // 2]."""
    cos = jnp.cos(angles)[:, None, :].astype(jnp.float32)
    sin = jnp.sin(angles)[:, None, :].astype(jnp.float32)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)
