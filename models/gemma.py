"""Gemma 2 and Gemma 3 (text): sandwich norms, GeGLU, soft-capping, alternating sliding windows.

Where they differ from Llama:
- RMSNorm scales by (1 + w) (`norm_offset`), and embeddings are multiplied by sqrt(hidden_size);
- four norms per layer: the attention and MLP outputs are normed again before the residual add;
- the MLP gate is GELU (tanh approximation); attention scores scale by query_pre_attn_scalar**-0.5;
- Gemma2 soft-caps attention scores and the final logits (c * tanh(x / c));
- sliding-window layers alternate with global ones (`layer_types`); in Gemma3 they also use their
  own RoPE base (`local_rope_theta`), and q and k get a (1 + w) RMSNorm per head.
The per-layer differences reach the scanned layer body as its `LayerSpec`.
"""

from __future__ import annotations

from flax import nnx

from xlaserve.kernels import AttentionBackend, AttentionMetadata, KVCache
from xlaserve.models.config import TransformerConfig
from xlaserve.models.decoder import DecoderOnlyLM
from xlaserve.models.layers import Attention, GatedMLP, LayerSpec, RMSNorm


class GemmaDecoderLayer(nnx.Module):
    """x + post_attn_norm(attn(input_norm(x))), then x + post_ffw_norm(mlp(pre_ffw_norm(x)))."""

    def __init__(self, cfg: TransformerConfig, backend: AttentionBackend, *, dtype, rngs: nnx.Rngs):
        def norm() -> RMSNorm:
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=cfg.norm_offset, dtype=dtype)

        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, backend, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = GatedMLP(cfg, dtype=dtype, rngs=rngs)
        self.post_feedforward_layernorm = norm()

    def __call__(self, x, positions, kv_cache: KVCache, md: AttentionMetadata, spec: LayerSpec):
        h, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, md, spec)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), kv_cache


class Gemma2ForCausalLM(DecoderOnlyLM):
    layer_class = GemmaDecoderLayer


class Gemma3ForCausalLM(DecoderOnlyLM):
    layer_class = GemmaDecoderLayer
