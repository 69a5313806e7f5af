"""Layers shared by the model families: norms, projections, attention over the paged cache, MLP."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kernels import AttentionBackend, AttentionMetadata, KVCache
from models.config import TransformerConfig
from models.rope import apply_rope, rope_angles


class RMSNorm(nnx.Module):
    """Root-mean-square norm, computed in float32 like Hugging Face's."""

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * x32.astype(x.dtype)


class Linear(nnx.Module):
    """y = x @ W (+ b) with W stored [in, out]; loaders transpose Hugging Face's [out, in]."""

    def __init__(self, din: int, dout: int, *, use_bias: bool = False, dtype=jnp.float32, rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(0.02)
        self.kernel = nnx.Param(init(rngs.params(), (din, dout), dtype))
        self.bias = nnx.Param(jnp.zeros((dout,), dtype)) if use_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x @ self.kernel[...]
        return y if self.bias is None else y + self.bias[...]


class Attention(nnx.Module):
    """Grouped-query self-attention whose keys and values live in the paged KV cache."""

    def __init__(self, cfg: TransformerConfig, backend: AttentionBackend, *, dtype, rngs: nnx.Rngs):
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(d, cfg.num_heads * hd, use_bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(d, cfg.num_kv_heads * hd, use_bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(d, cfg.num_kv_heads * hd, use_bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(cfg.num_heads * hd, d, use_bias=False, dtype=dtype, rngs=rngs)
        self.cfg = cfg
        self.backend = backend

    def __call__(
        self,
        x: jax.Array,  # [T, D]
        positions: jax.Array,  # [T]
        kv_cache: KVCache,
        md: AttentionMetadata,  # already offset to this layer's blocks
    ) -> tuple[jax.Array, KVCache]:
        cfg = self.cfg
        num_tokens = x.shape[0]
        q = self.q_proj(x).reshape(num_tokens, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        angles = rope_angles(
            positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict, cfg.max_position_embeddings
        )
        q, k = apply_rope(q, angles), apply_rope(k, angles)
        k_cache, v_cache = self.backend.write_kv(kv_cache.k, kv_cache.v, k, v, md.slot_mapping)
        out = self.backend.attention(
            q,
            k_cache,
            v_cache,
            md.kv_lens,
            md.block_tables,
            md.query_start_loc,
            md.num_seqs,
            sm_scale=cfg.head_dim**-0.5,
        )
        return self.o_proj(out.reshape(num_tokens, -1)), KVCache(k_cache, v_cache)


class GatedMLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: TransformerConfig, *, dtype, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(d, f, use_bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(d, f, use_bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(f, d, use_bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
