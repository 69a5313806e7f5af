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

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.kernels import AttentionBackend, AttentionMetadata, KVCache
from xlaserve.kernels.hybrid_cache import HybridCache, HybridCacheSpec
from xlaserve.kernels.ssd import MambaCache
from xlaserve.models.config import TransformerConfig
from xlaserve.models.hybrid import HybridConfig, HybridDecoderLM, hybrid_cache_spec
from xlaserve.models.layers import Attention, GatedMLP, LayerSpec, RMSNorm, activation
from xlaserve.models.mamba2 import (
    Mamba2Config,
    Mamba2Mixer,
    _read_float,
    group_copies,
    group_mamba2_tensors,
)


@dataclass(frozen=True)
class FalconH1Config(HybridConfig):
    mamba_d_ssm: int = 0
    mamba_n_heads: int = 0
    mamba_d_head: int = 0
    mamba_d_state: int = 0
    mamba_n_groups: int = 1
    mamba_group_copies: int = 1  # under tensor parallelism (Mamba2Config.group_copies)
    mamba_d_conv: int = 4
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_gate_norm: str = "none"
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    lm_head_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    ssm_multipliers: tuple[float, ...] = (1.0,) * 5  # z, x, B, C, dt
    mlp_multipliers: tuple[float, float] = (1.0, 1.0)  # gate, down

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        num_layers = hf["num_hidden_layers"]
        fields = super().fields_from_hf({**hf, "layer_types": ["hybrid"] * num_layers})
        hidden, heads = hf["hidden_size"], hf.get("mamba_n_heads", 128)
        d_ssm = hf.get("mamba_d_ssm") or int(hf.get("mamba_expand", 2) * hidden)
        d_head = hf.get("mamba_d_head", "auto")
        limit = hf.get("time_step_limit") or (0.0, float("inf"))
        head_dim = fields["head_dim"]
        gate_norm = "none"
        if hf.get("mamba_rms_norm", False):
            gate_norm = "before_gate" if hf.get("mamba_norm_before_gate", True) else "after_gate"
        return {
            **fields,
            "embed_scale": float(hf.get("embedding_multiplier", 1.0)),
            # Keys times key_multiplier: the same scores as the scale times it.
            "query_pre_attn_scalar": (head_dim**-0.5 * float(hf.get("key_multiplier", 1.0))) ** -2,
            "mamba_d_ssm": d_ssm,
            "mamba_n_heads": heads,
            "mamba_d_head": d_ssm // heads if d_head == "auto" else d_head,
            "mamba_d_state": hf.get("mamba_d_state", 256),
            "mamba_n_groups": hf.get("mamba_n_groups", 1),
            "mamba_d_conv": hf.get("mamba_d_conv", 4),
            "mamba_chunk_size": hf.get("mamba_chunk_size", 256),
            "mamba_conv_bias": bool(hf.get("mamba_conv_bias", True)),
            "mamba_proj_bias": bool(hf.get("mamba_proj_bias", False)),
            "mamba_gate_norm": gate_norm,
            "time_step_limit": (_read_float(limit[0]), _read_float(limit[1])),
            "lm_head_multiplier": float(hf.get("lm_head_multiplier", 1.0)),
            "attention_in_multiplier": float(hf.get("attention_in_multiplier", 1.0)),
            "attention_out_multiplier": float(hf.get("attention_out_multiplier", 1.0)),
            "ssm_in_multiplier": float(hf.get("ssm_in_multiplier", 1.0)),
            "ssm_out_multiplier": float(hf.get("ssm_out_multiplier", 1.0)),
            "ssm_multipliers": tuple(float(m) for m in hf.get("ssm_multipliers") or (1.0,) * 5),
            "mlp_multipliers": tuple(float(m) for m in hf.get("mlp_multipliers") or (1.0, 1.0)),
        }

    def for_tensor_parallel(self, tensor_parallel_size: int):
        return self.replace(mamba_group_copies=group_copies(self.mamba_n_groups, tensor_parallel_size))

    @property
    def mamba(self) -> Mamba2Config:
        """The Mamba2 mixer's config: the shared fields, with the SSM's heads and widths."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(TransformerConfig)}
        return Mamba2Config(
            **{
                **shared,
                "intermediate_size": self.mamba_d_ssm,
                "num_heads": self.mamba_n_heads,
                "num_kv_heads": self.mamba_n_heads,
                "head_dim": self.mamba_d_head,
                "partial_rotary_factor": 0.0,
            },
            state_size=self.mamba_d_state,
            n_groups=self.mamba_n_groups,
            group_copies=self.mamba_group_copies,
            conv_kernel=self.mamba_d_conv,
            chunk_size=self.mamba_chunk_size,
            use_conv_bias=self.mamba_conv_bias,
            use_bias=self.mamba_proj_bias,
            time_step_limit=self.time_step_limit,
            gate_norm=self.mamba_gate_norm,
        )


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


class FalconH1ForCausalLM(HybridDecoderLM):
    config_class = FalconH1Config
    parallel_layer_class = FalconH1Layer

    @classmethod
    def kv_cache_spec(cls, cfg: FalconH1Config) -> HybridCacheSpec:
        mamba = cfg.mamba
        return hybrid_cache_spec(
            cfg,
            conv_kernel=mamba.conv_kernel,
            conv_dim=mamba.conv_dim,
            recurrent_shape=(mamba.num_heads, mamba.head_dim, mamba.state_size),
        )

    @classmethod
    def prepare_hf_tensors(cls, cfg: FalconH1Config, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """`model.final_layernorm` is the shared decoder's `model.norm`."""
        renamed = {name.replace("model.final_layernorm.", "model.norm."): t for name, t in tensors.items()}
        return group_mamba2_tensors(cfg.mamba, renamed)

    def compute_logits(self, hidden: jax.Array, head_dv: jax.Array | None = None) -> jax.Array:
        return super().compute_logits(hidden, head_dv) * self.cfg.lm_head_multiplier
