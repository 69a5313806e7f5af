"""OLMo 2 and OLMo 3 (Olmo2ForCausalLM, Olmo3ForCausalLM): norms after each block, not before.

Where they differ from Llama:
- each block's output is normed before the residual add, and its input is not:
  x + post_attention_layernorm(attn(x)), then x + post_feedforward_layernorm(mlp(x));
- q and k are each normed over their whole projection (every head together, `q_norm` of
  num_heads * head_dim), before they are split into heads and rotated;
- OLMo 3 slides a window on three layers of four (`layer_types`), with its own RoPE per layer
  type where the config gives one: the shared `Attention` reads both from the config.
"""

from __future__ import annotations

import jax
from flax import nnx

from xlaserve.kernels import AttentionBackend, AttentionMetadata, KVCache
from xlaserve.models.config import TransformerConfig
from xlaserve.models.layers import Attention, GatedMLP, LayerSpec, RMSNorm
from xlaserve.models.llama import LlamaForCausalLM


class OlmoAttention(Attention):
    def __init__(self, cfg: TransformerConfig, backend: AttentionBackend, *, dtype, rngs: nnx.Rngs):
        super().__init__(cfg, backend, dtype=dtype, rngs=rngs)
        hd, eps = cfg.head_dim, cfg.rms_norm_eps
        self.q_norm = RMSNorm(cfg.num_heads * hd, eps, dtype=dtype)
        self.k_norm = RMSNorm(cfg.num_kv_heads * hd, eps, dtype=dtype)

    def project_qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        q, k, v = super().project_qkv(x)
        return self.q_norm(q), self.k_norm(k), v


class OlmoDecoderLayer(nnx.Module):
    """x + post_attention_layernorm(attn(x)), then x + post_feedforward_layernorm(mlp(x))."""

    supports_lora = True  # its projections are Linears an adapter may target (models/lora.py)

    def __init__(self, cfg: TransformerConfig, backend: AttentionBackend, *, dtype, rngs: nnx.Rngs):
        self.self_attn = OlmoAttention(cfg, backend, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = GatedMLP(cfg, dtype=dtype, rngs=rngs)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def __call__(self, x, positions, kv_cache: KVCache, md: AttentionMetadata, spec: LayerSpec):
        h, kv_cache = self.self_attn(x, positions, kv_cache, md, spec)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(x)), kv_cache


class Olmo2ForCausalLM(LlamaForCausalLM):
    layer_class = OlmoDecoderLayer


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    pass
