"""OLMo 2 and OLMo 3 (Olmo2ForCausalLM, Olmo3ForCausalLM): norms after each block, not before;
OLMoE (OlmoeForCausalLM): their attention in Llama's pre-norm layer, a mixture of experts its MLP.

Where they differ from Llama:
- each block's output is normed before the residual add, and its input is not:
  x + post_attention_layernorm(attn(x)), then x + post_feedforward_layernorm(mlp(x));
- q and k are each normed over their whole projection (every head together, `q_norm` of
  num_heads * head_dim), before they are split into heads and rotated;
- OLMo 3 slides a window on three layers of four (`layer_types`), with its own RoPE per layer
  type where the config gives one: the shared `Attention` reads both from the config.
OLMoE routes by softmax, top k, not renormalized unless `norm_topk_prob`; `clip_qkv` clamps q, k
(after their norms) and v.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from xlaserve.kernels import AttentionBackend, AttentionMetadata, KVCache
from xlaserve.models.config import TransformerConfig
from xlaserve.models.layers import Attention, GatedMLP, LayerSpec, RMSNorm
from xlaserve.models.llama import LlamaForCausalLM
from xlaserve.models.moe import MoEConfig, MoEDecoderLayer, MoEForCausalLM


class OlmoAttention(Attention):
    def __init__(self, cfg: TransformerConfig, backend: AttentionBackend, *, dtype, rngs: nnx.Rngs):
        super().__init__(cfg, backend, dtype=dtype, rngs=rngs)
        hd, eps = cfg.head_dim, cfg.rms_norm_eps
        self.q_norm = RMSNorm(cfg.num_heads * hd, eps, dtype=dtype)
        self.k_norm = RMSNorm(cfg.num_kv_heads * hd, eps, dtype=dtype)

    def project_qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        q, k, v = super().project_qkv(x)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.cfg.clip_qkv is not None:
            c = self.cfg.clip_qkv
            q, k, v = (jnp.clip(a, -c, c) for a in (q, k, v))
        return q, k, v


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


@dataclass(frozen=True)
class OlmoeConfig(MoEConfig):
    norm_topk_prob: bool = False  # Hugging Face's OlmoeConfig default

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        return {
            **super().fields_from_hf(hf),
            "num_experts": hf["num_experts"],
            "clip_qkv": hf.get("clip_qkv"),
        }


class OlmoeDecoderLayer(MoEDecoderLayer):
    attention_class = OlmoAttention


class OlmoeForCausalLM(MoEForCausalLM):
    config_class = OlmoeConfig
    layer_class = OlmoeDecoderLayer
