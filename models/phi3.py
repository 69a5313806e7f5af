"""Phi-3 / Phi-3.5 / Phi-4-mini: the Llama layer with fused projections and partial RoPE.

Hugging Face stores q, k and v as one `qkv_proj` and gate and up as one `gate_up_proj`; we keep
them fused (one matmul each, and the weight names map one to one), and split the activations.
"""

from __future__ import annotations

import jax
from flax import nnx

from xlaserve.models.config import TransformerConfig
from xlaserve.models.layers import Attention, GatedMLP, Linear
from xlaserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class Phi3Attention(Attention):
    def init_projections(self, cfg: TransformerConfig, *, dtype, rngs: nnx.Rngs) -> None:
        width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, width, use_bias=cfg.attention_bias, dtype=dtype, rngs=rngs)

    def project_qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        q_width, kv_width = self.cfg.num_heads * self.cfg.head_dim, self.cfg.num_kv_heads * self.cfg.head_dim
        qkv = self.qkv_proj(x)  # [T, q_width + 2 * kv_width]: q, then k, then v
        return qkv[:, :q_width], qkv[:, q_width : q_width + kv_width], qkv[:, q_width + kv_width :]


class Phi3MLP(GatedMLP):
    def init_projections(self, cfg: TransformerConfig, *, dtype, rngs: nnx.Rngs) -> None:
        self.gate_up_proj = Linear(
            cfg.hidden_size, 2 * cfg.intermediate_size, use_bias=cfg.mlp_bias, dtype=dtype, rngs=rngs
        )

    def project_gate_up(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        gate_up = self.gate_up_proj(x)  # [T, 2F]: gate, then up
        f = gate_up.shape[-1] // 2
        return gate_up[:, :f], gate_up[:, f:]


class Phi3DecoderLayer(LlamaDecoderLayer):
    attention_class = Phi3Attention
    mlp_class = Phi3MLP


class Phi3ForCausalLM(LlamaForCausalLM):
    layer_class = Phi3DecoderLayer
