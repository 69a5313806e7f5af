"""Falcon-H1 (FalconH1ForCausalLM): attention and Mamba2 side by side in every layer, with muP multipliers.

Every layer is a parallel hybrid (models/hybrid.py's PARALLEL kind): one norm, then Mamba2's mixer
(models/mamba2.py: its conv and SSM state in the layer's state slot) and attention (paged K/V) on the
same normed input, their outputs scaled and summed into the residual; then a SwiGLU MLP. The
multipliers Falcon-H1 was trained with (muP) are kept where Hugging Face applies them:

- the embeddings times `embedding_multiplier`, the logits times `lm_head_multiplier`;
- attention: its input times `attention_in_multiplier`, its output times `attention_out_multiplier`;
  keys times `key_multiplier`, folded into the score scale (a key only ever meets a query's dot);
- Mamba2: its input times `ssm_in_multiplier`, the five parts of `in_proj`'s output (z, x, B, C, dt)
  each times its `ssm_multipliers` entry, its output times `ssm_out_multiplier`;
- the MLP: the gate projection times `mlp_multipliers[0]` before the activation, the output times
  `mlp_multipliers[1]`.

The mixer's width is `mamba_d_ssm` (else expand * hidden_size); its output is gated by silu(z) and,
with `mamba_rms_norm`, RMS-normed per group before (`mamba_norm_before_gate`) or after the gate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.kernels import AttentionBackend, AttentionMetadata, KVCache
from xlaserve.kernels.hybrid_cache import HybridCache
from xlaserve.kernels.ssd import MambaCache
from xlaserve.models.layers import Attention, GatedMLP, LayerSpec, RMSNorm, activation
from xlaserve.models.mamba2 import Mamba2Mixer, group_mamba2_tensors
from xlaserve.models.mamba2_hybrid import Mamba2HybridConfig, Mamba2HybridLM


@dataclass(frozen=True)
class FalconH1Config(Mamba2HybridConfig):
    lm_head_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    ssm_multipliers: tuple[float, ...] = (1.0,) * 5  # z, x, B, C, dt
    mlp_multipliers: tuple[float, float] = (1.0, 1.0)  # gate, down
    mamba_gate_norm: str = "none"  # without `mamba_rms_norm`: y * silu(z), no norm

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        num_layers = hf["num_hidden_layers"]
        fields = super().fields_from_hf({**hf, "layer_types": ["hybrid"] * num_layers})
        head_dim = fields["head_dim"]
        gate_norm = "none"
        if hf.get("mamba_rms_norm", False):
            gate_norm = "before_gate" if hf.get("mamba_norm_before_gate", True) else "after_gate"
        return {
            **fields,
            "embed_scale": float(hf.get("embedding_multiplier", 1.0)),
            # Keys times key_multiplier: the same scores as the scale times it.
            "query_pre_attn_scalar": (head_dim**-0.5 * float(hf.get("key_multiplier", 1.0))) ** -2,
            "mamba_gate_norm": gate_norm,
            "lm_head_multiplier": float(hf.get("lm_head_multiplier", 1.0)),
            "attention_in_multiplier": float(hf.get("attention_in_multiplier", 1.0)),
            "attention_out_multiplier": float(hf.get("attention_out_multiplier", 1.0)),
            "ssm_in_multiplier": float(hf.get("ssm_in_multiplier", 1.0)),
            "ssm_out_multiplier": float(hf.get("ssm_out_multiplier", 1.0)),
            "ssm_multipliers": tuple(float(m) for m in hf.get("ssm_multipliers") or (1.0,) * 5),
            "mlp_multipliers": tuple(float(m) for m in hf.get("mlp_multipliers") or (1.0, 1.0)),
        }


class FalconH1Mixer(Mamba2Mixer):
    """Mamba2's mixer with Falcon-H1's input multiplier and per-part output multipliers of in_proj."""

    def __init__(self, cfg: FalconH1Config, backend: AttentionBackend, *, dtype, rngs: nnx.Rngs):
        super().__init__(cfg.mamba, backend, dtype=dtype, rngs=rngs)
        mamba = cfg.mamba
        groups = mamba.ssm_groups
        inner, n = mamba.intermediate_size // groups, mamba.state_size
        widths = (inner, inner, n, n, mamba.num_heads // groups)  # per SSM group: z, x, B, C, dt
        self.in_multiplier = cfg.ssm_in_multiplier
        self.part_multipliers = tuple(zip(widths, cfg.ssm_multipliers, strict=True))
        self.groups = groups

    def project_in(self, x: jax.Array) -> jax.Array:
        h = self.in_proj(x * jnp.asarray(self.in_multiplier, x.dtype))
        # A trace-time constant: each part of the projection's output times its multiplier, in the
        # projection's per-group order (models/mamba2.py group_mamba2_tensors).
        group = np.concatenate([np.full(w, m, np.float32) for w, m in self.part_multipliers])
        return h * jnp.asarray(np.tile(group, self.groups), h.dtype)


class FalconH1MLP(GatedMLP):
    """down(silu(gate(x) * m_gate) * up(x)) * m_down."""

    def __init__(self, cfg: FalconH1Config, *, dtype, rngs: nnx.Rngs):
        super().__init__(cfg, dtype=dtype, rngs=rngs)
        self.multipliers = cfg.mlp_multipliers

    def __call__(self, x: jax.Array) -> jax.Array:
        m_gate, m_down = self.multipliers
        gate, up = self.project_gate_up(x)
        gate = gate.astype(jnp.float32) * m_gate
        h = (activation(self.hidden_act)(gate) * up.astype(jnp.float32)).astype(x.dtype)
        return self.down_proj(h) * jnp.asarray(m_down, x.dtype)


class FalconH1Layer(nnx.Module):
    """x + ssm_out * mamba(n) + attn_out * attn(attn_in * n) with n = norm(x), then x + mlp(norm(x))."""

    def __init__(self, cfg: FalconH1Config, backend: AttentionBackend, *, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mamba = FalconH1Mixer(cfg, backend, dtype=dtype, rngs=rngs)
        self.self_attn = Attention(cfg, backend, dtype=dtype, rngs=rngs)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.feed_forward = FalconH1MLP(cfg, dtype=dtype, rngs=rngs)
        self.multipliers = (cfg.ssm_out_multiplier, cfg.attention_in_multiplier, cfg.attention_out_multiplier)

    def __call__(
        self,
        x,
        positions,
        cache: HybridCache,
        md: AttentionMetadata,
        spec: LayerSpec,
        rows: jax.Array,
    ):
        ssm_out, attn_in, attn_out = (jnp.asarray(m, x.dtype) for m in self.multipliers)
        h = self.input_layernorm(x)
        m, state = self.mamba(h, MambaCache(cache.conv, cache.recurrent), md, rows)
        a, kv = self.self_attn(h * attn_in, positions, KVCache(cache.k, cache.v), md, spec)
        x = x + (m * ssm_out + a * attn_out)
        x = x + self.feed_forward(self.pre_ff_layernorm(x))
        return x, HybridCache(kv.k, kv.v, state.conv, state.ssm)


class FalconH1ForCausalLM(Mamba2HybridLM):
    config_class = FalconH1Config
    parallel_layer_class = FalconH1Layer

    def compute_logits(self, hidden: jax.Array, head_dv: jax.Array | None = None) -> jax.Array:
        return super().compute_logits(hidden, head_dv) * self.cfg.lm_head_multiplier

    @classmethod
    def prepare_hf_tensors(cls, cfg: FalconH1Config, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """`model.final_layernorm` is the shared decoder's `model.norm`."""
        renamed = {name.replace("model.final_layernorm.", "model.norm."): t for name, t in tensors.items()}
        return group_mamba2_tensors(cfg.mamba, renamed)
