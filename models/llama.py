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
from xlaserve.models.lora import LayerLoRA, lora_kwargs


class LlamaDecoderLayer(nnx.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x))."""

    attention_class: type[Attention] = Attention  # a family with fused projections swaps these
    mlp_class: type[GatedMLP] = GatedMLP
    supports_lora = True  # takes `lora=` (models/lora.py): adapters on its projections

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
        lora: LayerLoRA | None = None,
    ):
        attn_lora = lora_kwargs(lora, "self_attn")
        mlp_lora = lora_kwargs(lora, "mlp")
        h, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, md, spec, **attn_lora)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x), **mlp_lora), kv_cache


class LlamaForCausalLM(DecoderOnlyLM):
    layer_class = LlamaDecoderLayer
