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

from dataclasses import dataclass
from typing import Any

from flax import nnx

from xlaserve.kernels import AttentionBackend, AttentionMetadata, KVCache
from xlaserve.models.config import TransformerConfig
from xlaserve.models.decoder import DecoderOnlyLM
from xlaserve.models.layers import Attention, GatedMLP, LayerSpec, RMSNorm


@dataclass(frozen=True)
class GemmaConfig(TransformerConfig):
    """What Gemma 2 and 3 read alike: (1 + w) norms, sqrt(hidden_size) embedding scale, the GELU
    gate (`hidden_activation`), the attention scale and the final logit soft cap."""

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        return {
            **super().fields_from_hf(hf),
            "hidden_act": hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
            "norm_offset": 1.0,
            "embed_scale": hf["hidden_size"] ** 0.5,
            "query_pre_attn_scalar": hf.get("query_pre_attn_scalar"),
            "final_logit_softcap": hf.get("final_logit_softcapping"),
        }


@dataclass(frozen=True)
class Gemma2Config(GemmaConfig):
    """Gemma2 also soft-caps attention scores; without `layer_types`, even layers (0, 2, ...) slide."""

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        return {**super().fields_from_hf(hf), "attn_logit_softcap": hf.get("attn_logit_softcapping")}

    @classmethod
    def default_sliding_layers(cls, hf: dict[str, Any], num_layers: int) -> list[bool]:
        return [(i + 1) % 2 != 0 for i in range(num_layers)]


@dataclass(frozen=True)
class Gemma3Config(GemmaConfig):
    """Gemma3 norms q and k per head (Hugging Face's Gemma3 attention ignores
    attn_logit_softcapping, and its configs set none); without `layer_types`, every
    `sliding_window_pattern`-th layer is global, the rest slide."""

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        return {**super().fields_from_hf(hf), "qk_norm": True}

    @classmethod
    def default_sliding_layers(cls, hf: dict[str, Any], num_layers: int) -> list[bool]:
        pattern = hf.get("sliding_window_pattern", 6)
        return [(i + 1) % pattern != 0 for i in range(num_layers)]


class GemmaDecoderLayer(nnx.Module):
    """x + post_attn_norm(attn(input_norm(x))), then x + post_ffw_norm(mlp(pre_ffw_norm(x)))."""

    supports_lora = True  # its projections are Linears an adapter may target (models/lora.py)

    def __init__(self, cfg: TransformerConfig, backend: AttentionBackend, *, dtype, rngs: nnx.Rngs):
        def norm() -> RMSNorm:
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=cfg.norm_offset, dtype=dtype)

        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, backend, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = GatedMLP(cfg, dtype=dtype, rngs=rngs)
        self.post_feedforward_layernorm = norm()

    def __call__(
        self,
        x,
        positions,
        kv_cache: KVCache,
        md: AttentionMetadata,
        spec: LayerSpec,
    ):
        h, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, md, spec)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h), kv_cache


class Gemma2ForCausalLM(DecoderOnlyLM):
    config_class = Gemma2Config
    layer_class = GemmaDecoderLayer


class Gemma3ForCausalLM(DecoderOnlyLM):
    config_class = Gemma3Config
    layer_class = GemmaDecoderLayer
