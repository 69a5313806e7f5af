"""Qwen3.5 (text): gated DeltaNet linear attention in most layers, gated full attention in the rest.

Layers follow a period (config.json's `layer_types`; Qwen3.5's: three linear-attention layers, then
one full-attention layer). Every layer is x + mixer(norm(x)), then x + mlp(norm(x)), with
zero-centred RMSNorms (scale 1 + w), under the hybrid backbone of models/hybrid.py. The mixers:

- Gated DeltaNet (`GatedDeltaNet`): x projects to q, k, v (through a causal depthwise conv and silu),
  a gate z, a write strength beta = sigmoid(b) and a decay g = -exp(A_log) softplus(a + dt_bias) per
  value head; the gated delta rule (kernels/gated_delta.py) runs over a state [Dk, Dv] per value
  head; its output is RMS-normed per head, times silu(z), and projected back. The q, k, v
  channels (in_proj_qkv's columns, the conv's channels and its state) are stored grouped by key head
  (`prepare_hf_tensors`: each key head's q, k, then its value heads' v; Qwen3-Next's own order), so
  that a contiguous split over the tensor-parallel ranks gives each rank whole key heads with their
  value heads; z, b, a and the recurrent state split by value head, out_proj by its input
  (sharding/rules.py).
- Attention: the shared `Attention` with q/k RMSNorm, partial RoPE (a quarter of head_dim) and an
  output gate (q_proj also gives a gate per head: out * sigmoid(gate)).

The cache is a `HybridCache`: paged K/V for the attention layers (the step's block table), and per
state slot (the step's `state_slots`: core/kv_cache_spec.py StateSpec with a pool of its own) each
linear layer's last K - 1 conv inputs and its float32 recurrent state, zeroed for a sequence that
starts at position 0 and written back in place.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.kernels import AttentionBackend, AttentionMetadata, KVCache
from xlaserve.kernels.gated_delta import chunk_terms_reference, ragged_gated_delta_rule
from xlaserve.kernels.hybrid_cache import HybridCache, HybridCacheSpec
from xlaserve.kernels.invariant import invariant_mean
from xlaserve.kernels.ssd import entering_states, ragged_causal_conv1d
from xlaserve.models.hybrid import HybridConfig, HybridDecoderLM, hybrid_cache_spec
from xlaserve.models.layers import Attention, GatedMLP, LayerSpec, Linear, RMSNorm
from xlaserve.models.mamba2 import DepthwiseConv1d

CHUNK_SIZE = 64  # the delta rule's chunks (Hugging Face's and FLA's)
_GROUPED_BY_KEY_HEAD = re.compile(r"\.linear_attn\.(in_proj_qkv|conv1d)\.weight$")


@dataclass(frozen=True)
class Qwen3_5Config(HybridConfig):
    """Qwen3.5's text config: Gated DeltaNet's widths beside the attention's."""

    linear_num_key_heads: int = 16  # Hk
    linear_num_value_heads: int = 32  # Hv
    linear_key_head_dim: int = 128  # Dk
    linear_value_head_dim: int = 128  # Dv
    linear_conv_kernel_dim: int = 4  # K

    def __post_init__(self):
        super().__post_init__()
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        return {
            **super().fields_from_hf(hf),
            "qk_norm": True,
            "norm_offset": 1.0,
            "attn_output_gate": True,
            "linear_num_key_heads": hf["linear_num_key_heads"],
            "linear_num_value_heads": hf["linear_num_value_heads"],
            "linear_key_head_dim": hf["linear_key_head_dim"],
            "linear_value_head_dim": hf["linear_value_head_dim"],
            "linear_conv_kernel_dim": hf.get("linear_conv_kernel_dim", 4),
        }

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def channels_per_key_head(self) -> int:
        """A key head's q, k and its value heads' v, side by side in the conv's channels."""
        return 2 * self.linear_key_head_dim + self.value_dim // self.linear_num_key_heads


def group_by_key_head(cfg: Qwen3_5Config, weight: np.ndarray) -> np.ndarray:
    """Rows [q of all key heads | k of all | v of all value heads] (Hugging Face's Qwen3.5 order) ->
    per key head [its q | its k | its value heads' v]. Depthwise, the conv computes the same per
    channel in either order; grouped, a contiguous split is a split by key head."""
    hk = cfg.linear_num_key_heads
    q, k, v = np.split(weight, [cfg.key_dim, 2 * cfg.key_dim])
    per_head = [x.reshape(hk, -1, *weight.shape[1:]) for x in (q, k, v)]
    return np.concatenate(per_head, axis=1).reshape(weight.shape)


class GatedRMSNorm(nnx.Module):
    """Per value head: weight * RMS-norm(o) in o's dtype, times silu(z) in float32 (Hugging Face's
    Qwen3_5RMSNormGated: the norm before the gate)."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, o: jax.Array, z: jax.Array) -> jax.Array:  # [.., Dv] each
        o32 = o.astype(jnp.float32)
        o32 = o32 * jax.lax.rsqrt(invariant_mean(o32 * o32, keepdims=True) + self.eps)
        h = self.weight[...] * o32.astype(o.dtype)
        return (h.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(o.dtype)


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg: Qwen3_5Config, *, dtype, rngs: nnx.Rngs, chunk_terms=chunk_terms_reference):
        # The chunked form's per-chunk part: the reference, or the Pallas kernel (kernels/backend.py).
        self.chunk_terms = chunk_terms
        self.cfg = cfg
        d, heads = cfg.hidden_size, cfg.linear_num_value_heads
        self.in_proj_qkv = Linear(d, cfg.conv_dim, dtype=dtype, rngs=rngs)
        self.in_proj_z = Linear(d, cfg.value_dim, dtype=dtype, rngs=rngs)
        self.in_proj_b = Linear(d, heads, dtype=dtype, rngs=rngs)
        self.in_proj_a = Linear(d, heads, dtype=dtype, rngs=rngs)
        self.conv1d = DepthwiseConv1d(
            cfg.conv_dim, cfg.linear_conv_kernel_dim, use_bias=False, dtype=dtype, rngs=rngs
        )
        self.dt_bias = nnx.Param(jnp.ones((heads,), dtype))
        self.A_log = nnx.Param(jnp.zeros((heads,), dtype))
        self.norm = GatedRMSNorm(cfg.linear_value_head_dim, cfg.rms_norm_eps, dtype=dtype)
        self.out_proj = Linear(cfg.value_dim, d, dtype=dtype, rngs=rngs)

    def __call__(
        self, x: jax.Array, cache: HybridCache, md: AttentionMetadata, rows: jax.Array
    ) -> tuple[jax.Array, HybridCache]:  # x [T, D]; rows [R]: each sequence's row in the state arrays
        cfg = self.cfg
        num_tokens = x.shape[0]
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        qsl = md.query_start_loc
        conv_in, state_in = entering_states(
            md, rows, cache.conv[:, 0], cache.recurrent
        )  # [R, K-1, Cd], [R, Hv, Dk, Dv]
        qkv, conv_out = ragged_causal_conv1d(
            self.in_proj_qkv(x), self.conv1d.weight[...][:, 0], None, conv_in, qsl
        )
        qkv = jax.nn.silu(qkv.astype(jnp.float32)).astype(x.dtype)
        per_head = qkv.reshape(num_tokens, hk, cfg.channels_per_key_head)  # grouped by key head
        q, k, v = jnp.split(per_head, [dk, 2 * dk], axis=-1)
        beta = jax.nn.sigmoid(self.in_proj_b(x))
        a = self.in_proj_a(x).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a)
        o, state_out = ragged_gated_delta_rule(
            q,
            k,
            v.reshape(num_tokens, hv, dv),
            g,
            beta,
            qsl,
            state_in,
            chunk_size=min(CHUNK_SIZE, num_tokens),
            chunk_terms=self.chunk_terms,
        )
        z = self.in_proj_z(x).reshape(num_tokens, hv, dv)
        o = self.norm(o.astype(x.dtype), z).reshape(num_tokens, cfg.value_dim)
        cache = HybridCache(
            k=cache.k,
            v=cache.v,
            conv=cache.conv.at[rows, 0].set(conv_out.astype(cache.conv.dtype)),
            recurrent=cache.recurrent.at[rows].set(state_out),
        )
        return self.out_proj(o), cache


class _Qwen3_5Layer(nnx.Module):
    """The norms and MLP every layer has; the mixer is the subclass's."""

    mlp_class: type[nnx.Module] = GatedMLP  # Qwen3-Next: its mixture of experts
    # Its attention's and MLP's projections are Linears an adapter may target (models/lora.py); the
    # Gated DeltaNet's (in_proj_qkv, out_proj, ...) are no LoRA target (models/lora_adapter.py refuses them).
    supports_lora = True

    def __init__(self, cfg: Qwen3_5Config, *, dtype):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=1.0, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=1.0, dtype=dtype)

    def finish(self, x: jax.Array, h: jax.Array) -> jax.Array:
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3_5LinearLayer(_Qwen3_5Layer):
    def __init__(self, cfg: Qwen3_5Config, backend: AttentionBackend, *, dtype, rngs: nnx.Rngs):
        super().__init__(cfg, dtype=dtype)
        self.linear_attn = GatedDeltaNet(cfg, dtype=dtype, rngs=rngs, chunk_terms=backend.delta_chunk_terms)
        self.mlp = type(self).mlp_class(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x, cache: HybridCache, md: AttentionMetadata, rows: jax.Array):
        h, cache = self.linear_attn(self.input_layernorm(x), cache, md, rows)
        return self.finish(x, h), cache


class Qwen3_5AttentionLayer(_Qwen3_5Layer):
    def __init__(self, cfg: Qwen3_5Config, backend: AttentionBackend, *, dtype, rngs: nnx.Rngs):
        super().__init__(cfg, dtype=dtype)
        self.self_attn = Attention(cfg, backend, dtype=dtype, rngs=rngs)
        self.mlp = type(self).mlp_class(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, cache: HybridCache, md: AttentionMetadata, spec: LayerSpec):
        h, kv = self.self_attn(self.input_layernorm(x), positions, KVCache(cache.k, cache.v), md, spec)
        return self.finish(x, h), HybridCache(kv.k, kv.v, cache.conv, cache.recurrent)


class Qwen3_5ForCausalLM(HybridDecoderLM):
    config_class = Qwen3_5Config
    linear_layer_class: type[nnx.Module] = Qwen3_5LinearLayer
    attention_layer_class: type[nnx.Module] = Qwen3_5AttentionLayer

    @classmethod
    def prepare_hf_tensors(cls, cfg: Qwen3_5Config, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The q, k, v rows of in_proj_qkv and of the conv regrouped by key head (`group_by_key_head`).
        The multi-token prediction layer's `mtp.*` tensors are not the decoder's (models/mtp.py loads them
        for speculative decoding)."""
        return {
            name: group_by_key_head(cfg, np.asarray(t)) if _GROUPED_BY_KEY_HEAD.search(name) else t
            for name, t in tensors.items()
            if not name.startswith("mtp.")
        }

    @classmethod
    def kv_cache_spec(cls, cfg: Qwen3_5Config) -> HybridCacheSpec:
        return hybrid_cache_spec(
            cfg,
            conv_kernel=cfg.linear_conv_kernel_dim,
            conv_dim=cfg.conv_dim,
            recurrent_shape=(cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
        )
