"""Granite 3.x (GraniteForCausalLM): the Llama layer with Granite's four scalings; Granite 3.x MoE
(GraniteMoeForCausalLM): the same with a routed mixture of experts as its MLP.

Every residual branch is scaled by `residual_multiplier` before it is added (x + m * attn(norm(x)),
then x + m * mlp(norm(x))); the embeddings are multiplied by `embedding_multiplier`, the attention
scores by `attention_multiplier` (in place of head_dim^-0.5), and the logits divided by
`logits_scaling`. The experts route by softmax over the top k router logits (a softmax over all of
them renormalized over the top k); checkpoints store a layer's experts fused (`block_sparse_moe`'s
`input_linear` [E, 2F, D]: gate, then up; `output_linear` [E, D, F]; `router.layer`), which
`granite_expert_tensors` splits into the shared MoE block's names. Granite 4.0-H, the hybrid with
experts, is models/granite_hybrid.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx

from xlaserve.kernels import AttentionBackend, AttentionMetadata, KVCache
from xlaserve.models.config import TransformerConfig
from xlaserve.models.layers import LayerSpec
from xlaserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from xlaserve.models.moe import MoEConfig, SparseMoeBlock
from xlaserve.models.safetensors_loader import split_halves


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


@dataclass(frozen=True)
class GraniteMoeConfig(GraniteConfig, MoEConfig):
    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        return {
            **super().fields_from_hf(hf),
            "num_experts": hf["num_local_experts"],
            "moe_intermediate_size": hf["intermediate_size"],  # each expert's width
            "norm_topk_prob": True,  # softmax over the top k logits
        }


class GraniteMoeDecoderLayer(GraniteDecoderLayer):
    mlp_class = SparseMoeBlock


class GraniteMoeForCausalLM(GraniteForCausalLM):
    config_class = GraniteMoeConfig
    layer_class = GraniteMoeDecoderLayer

    @classmethod
    def prepare_hf_tensors(
        cls, cfg: GraniteMoeConfig, tensors: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        out = {}
        for name, tensor in tensors.items():
            m = _EXPERT_BLOCK.match(name)
            parts = None if m is None else granite_expert_tensors(f"{m['layer']}.mlp", m["part"], tensor)
            out.update({name: tensor} if parts is None else parts)
        return out


_EXPERT_BLOCK = re.compile(r"^(?P<layer>.+\.layers\.\d+)\.block_sparse_moe\.(?P<part>[\w.]+)$")


def granite_expert_tensors(block: str, part: str, tensor) -> dict[str, np.ndarray] | None:
    """A Granite expert block's checkpoint tensor `part` (the legacy fused names, or transformers 5's
    in-memory ones) as the shared MoE block's at `block`; None: not one of them."""
    if part in ("input_linear.weight", "experts.gate_up_proj"):
        gate, up = split_halves(tensor, axis=1)
        return {f"{block}.experts_gate.weight": gate, f"{block}.experts_up.weight": up}
    if part in ("output_linear.weight", "experts.down_proj"):
        return {f"{block}.experts_down.weight": tensor}
    if part in ("router.layer.weight", "router.weight"):
        return {f"{block}.gate.weight": tensor}
    return None
