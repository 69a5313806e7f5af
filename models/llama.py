"""The Llama family (Llama 2/3/3.1/3.2, SmolLM2): RMSNorm, RoPE, GQA, SwiGLU, tied or untied head.

Mistral and Qwen2/Qwen3 share this layer; what they change (sliding window, QKV bias, q/k norm)
comes from the config, read by the shared `Attention`.
"""

from __future__ import annotations

from flax import nnx

from xlaserve.kernels import AttentionBackend, AttentionMetadata, KVCache
from xlaserve.models.config import TransformerConfig
from xlaserve.models.decoder import DecoderOnlyLM
from xlaserve.models.layers import Attention, GatedMLP, LayerSpec, RMSNorm


class LlamaDecoderLayer(nnx.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x))."""

    attention_class: type[Attention] = Attention  # a family with fused projections swaps these
    mlp_class: type[GatedMLP] = GatedMLP
    supports_lora = True  # its projections are Linears an adapter may target (models/lora.py)

    def __init__(self, cfg: TransformerConfig, backend: AttentionBackend, *, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = type(self).attention_class(cfg, backend, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = type(self).mlp_class(cfg, dtype=dtype, rngs=rngs)

    def __call__(
        self,
        x,
        positions,
        kv_cache: KVCache,
        md: AttentionMetadata,
        spec: LayerSpec,
    ):
        h, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, md, spec)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv_cache


class LlamaForCausalLM(DecoderOnlyLM):
    layer_class = LlamaDecoderLayer
