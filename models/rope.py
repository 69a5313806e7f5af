"""Rotary position embeddings with the scaling variants Hugging Face configs carry."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.models.config import TransformerConfig


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


def _yarn_inv_freq(inv_freq: np.ndarray, head_dim: int, theta: float, scaling: dict[str, Any]) -> np.ndarray:
    """YaRN: interpolate (divide by `factor`) the low frequencies, keep the high ones, ramp between.

    The ramp runs over the dimensions whose wavelength fits between beta_fast and beta_slow
    rotations in original_max_position_embeddings (Hugging Face's `_compute_yarn_parameters`).
    """
    factor = scaling["factor"]
    old_len = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return head_dim * math.log(old_len / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(scaling: dict[str, Any]) -> float:
    """The factor YaRN multiplies cos and sin by (1.0 for every other scaling type)."""
    if scaling.get("rope_type", scaling.get("type", "default")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(scaling["factor"], mscale) / _yarn_mscale(scaling["factor"], mscale_all_dim)
    return _yarn_mscale(scaling["factor"])


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> np.ndarray:
    """Static inverse frequencies [head_dim // 2] for default, linear, llama3 and yarn scaling."""
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    inv_freq = base_inv_freq(head_dim, theta)
    if rope_type in ("default", "dynamic"):
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    if rope_type == "longrope":  # per sequence length: `longrope_angles`; these are the short ones
        return inv_freq / np.asarray(scaling["short_factor"])
    raise ValueError(
        f"rope_scaling type {rope_type!r} is not supported (default, linear, dynamic, llama3, yarn, longrope)"
    )


def layer_rope_inv_freqs(cfg: TransformerConfig) -> np.ndarray:  # [num_layers, rotary_dim // 2]
    """Each layer's inverse frequencies: sliding layers use `local_rope_theta` unscaled when the
    config has one (Gemma3), every other layer the scaled global RoPE. (Dynamic scaling depends on
    the position; `rope_angles` computes it, and these rows are its base frequencies.)"""
    scaling = cfg.rope_scaling_dict
    if scaling.get("rope_type", scaling.get("type")) == "dynamic":
        scaling = {}
    full = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, scaling)
    local = full if cfg.local_rope_theta is None else base_inv_freq(cfg.rotary_dim, cfg.local_rope_theta)
    rows = np.stack([full if w is None else local for w in cfg.layer_sliding_windows])
    rows[list(cfg.nope_layers)] = 0.0  # angle 0 at every position: cos 1, sin 0, q and k as they are
    return rows


def layer_rope_scales(cfg: TransformerConfig) -> np.ndarray:  # [num_layers]
    """Each layer's cos/sin multiplier: YaRN's or LongRoPE's attention factor, except on sliding
    layers with their own unscaled RoPE base; 1.0 for every other scaling type."""
    scaling = cfg.rope_scaling_dict
    if scaling.get("rope_type") == "longrope":
        factor = _longrope_attention_factor(scaling, cfg.max_position_embeddings)
    else:
        factor = rope_attention_factor(scaling)
    has_local = cfg.local_rope_theta is not None
    scales = np.asarray([1.0 if has_local and w is not None else factor for w in cfg.layer_sliding_windows])
    scales[list(cfg.nope_layers)] = 1.0
    return scales


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
    base = theta * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (
        head_dim / (head_dim - 2)
    )
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    inv_freq = 1.0 / (base[:, None] ** exponents[None, :])
    return pos[:, None] * inv_freq


def rope_cos_sin(angles: jax.Array, scale: float | jax.Array = 1.0) -> tuple[jax.Array, jax.Array]:
    """cos and sin of `angles` [T, R // 2] times `scale`: float32 [T, 1, R // 2] each, the factors
    `rotate_halves` multiplies a [T, H, R] array's halves by."""
    cos, sin = jnp.cos(angles) * scale, jnp.sin(angles) * scale
    return cos.astype(jnp.float32)[:, None, :], sin.astype(jnp.float32)[:, None, :]


def apply_rope(x: jax.Array, angles: jax.Array, scale: float | jax.Array = 1.0) -> jax.Array:
    """Rotate halves (the Hugging Face layout). x: [T, H, D]; angles: [T, R // 2], R <= D.
    `scale` multiplies cos and sin (YaRN's attention factor), as Hugging Face does."""
    return rotate_halves(x, rope_cos_sin(angles, scale))


def rotate_halves(x: jax.Array, cos_sin: tuple[jax.Array, jax.Array]) -> jax.Array:
    """x [T, H, D] rotated by `rope_cos_sin`'s factors ([T, 1, R // 2] each, R <= D): with R < D
    (partial rotary, Phi3) the first R dims of each head rotate and the rest pass through."""
    cos, sin = cos_sin
    rotary_dim = 2 * cos.shape[-1]
    x1, x2 = jnp.split(x[..., :rotary_dim].astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    if rotary_dim == x.shape[-1]:
        return rotated
    return jnp.concatenate([rotated, x[..., rotary_dim:]], axis=-1)


def _longrope_attention_factor(scaling: dict[str, Any], max_position_embeddings: int) -> float:
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / original
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def longrope_angles(
    positions: jax.Array,  # [T]
    seq_lens: jax.Array,  # [T] int32: the context length of each token's sequence after this step
    rotary_dim: int,
    theta: float,
    scaling: dict[str, Any],
) -> jax.Array:  # [T, rotary_dim // 2]
    """LongRoPE (Phi-3.5, Phi-4-mini): frequencies divided by `short_factor`, or by `long_factor` for a
    sequence longer than original_max_position_embeddings.

    Hugging Face picks the set per forward by its sequence length: a prompt prefilled whole and every
    decode step match it exactly (cached keys keep the rotation they were written with, as in HF).
    A long prompt prefilled in chunks uses the short set for the chunks that end within the
    original length, where one HF forward over the whole prompt would use the long set.
    """
    base = theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    short = jnp.asarray(1.0 / (np.asarray(scaling["short_factor"]) * base), jnp.float32)
    long = jnp.asarray(1.0 / (np.asarray(scaling["long_factor"]) * base), jnp.float32)
    is_long = seq_lens > scaling["original_max_position_embeddings"]
    inv_freq = jnp.where(is_long[:, None], long[None, :], short[None, :])
    return positions.astype(jnp.float32)[:, None] * inv_freq
