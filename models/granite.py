"""Granite 3.x (GraniteForCausalLM): the Llama layer with Granite's four scalings.

Every residual branch is scaled by `residual_multiplier` before it is added (x + m * attn(norm(x)),
then x + m * mlp(norm(x))); the embeddings are multiplied by `embedding_multiplier`, the attention
scores by `attention_multiplier` (in place of head_dim^-0.5), and the logits divided by
`logits_scaling`. Granite 4.0-H, the hybrid with experts, is models/granite_hybrid.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx

from xlaserve.kernels import AttentionBackend, AttentionMetadata, KVCache
from xlaserve.models.config import TransformerConfig
from xlaserve.models.layers import LayerSpec
from xlaserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM


def granite_scalings(hf: dict[str, Any]) -> dict[str, float]:
    """Granite's four scalings as config fields (Granite 4.0-H's too)."""
    return {
        "embed_scale": float(hf.get("embedding_multiplier", 1.0)),
        "residual_multiplier": float(hf.get("residual_multiplier", 1.0)),
        "logits_scaling": float(hf.get("logits_scaling", 1.0)),
        # The scores' scale is attention_multiplier: the scale is query_pre_attn_scalar ** -0.5.
        "query_pre_attn_scalar": float(hf.get("attention_multiplier", 1.0)) ** -2,
    }


@dataclass(frozen=True)
class GraniteConfig(TransformerConfig):
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        return {**super().fields_from_hf(hf), **granite_scalings(hf)}


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: GraniteConfig, backend: AttentionBackend, *, dtype, rngs: nnx.Rngs):
        super().__init__(cfg, backend, dtype=dtype, rngs=rngs)
        self.residual_multiplier = cfg.residual_multiplier

    def __call__(self, x, positions, kv_cache: KVCache, md: AttentionMetadata, spec: LayerSpec):
        m = np.asarray(self.residual_multiplier, x.dtype)
        h, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, md, spec)
        x = x + h * m
        return x + self.mlp(self.post_attention_layernorm(x)) * m, kv_cache


class GraniteForCausalLM(LlamaForCausalLM):
    config_class = GraniteConfig
    layer_class = GraniteDecoderLayer

    def compute_logits(self, hidden: jax.Array, head_dv: jax.Array | None = None) -> jax.Array:
        return super().compute_logits(hidden, head_dv) / self.cfg.logits_scaling
