"""Qwen1.5-MoE and Qwen2-MoE (Qwen2MoeForCausalLM): the Qwen2 layer (q/k/v biases) with a sparse
mixture of experts plus a gated shared expert.

Softmax over the router logits, top k, not renormalized unless `norm_topk_prob` (Hugging Face's
default is off, as in the released models); every token also goes through one shared expert (a
SwiGLU MLP of `shared_expert_intermediate_size`), its output scaled per token by
sigmoid(shared_expert_gate(x)). Qwen3-Next and Qwen3.5-MoE reuse this block (models/qwen3_next.py).
Every layer is sparse in the released models; dense layers among them (`mlp_only_layers`,
`decoder_sparse_step` > 1) are refused, as Qwen3-MoE refuses them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
from flax import nnx

from xlaserve.models.layers import GatedMLP, Linear
from xlaserve.models.llama import LlamaDecoderLayer
from xlaserve.models.moe import MoEConfig, MoEForCausalLM, SparseMoeBlock, check_all_layers_sparse
from xlaserve.models.qwen import Qwen2Config


@dataclass(frozen=True)
class SharedExpertMoEConfig(MoEConfig):
    """The MoE routing plus the width of the one gated shared expert."""

    shared_expert_intermediate_size: int = 0

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        return {
            **super().fields_from_hf(hf),
            "num_experts": hf["num_experts"],
            "shared_expert_intermediate_size": hf["shared_expert_intermediate_size"],
        }


class GatedSharedExpertMoeBlock(SparseMoeBlock):
    """The routed experts plus one shared expert, its output scaled per token by
    sigmoid(shared_expert_gate(x)) (Hugging Face's Qwen2MoeSparseMoeBlock)."""

    def __init__(self, cfg: SharedExpertMoEConfig, *, dtype, rngs: nnx.Rngs):
        super().__init__(cfg, dtype=dtype, rngs=rngs)  # no `shared_experts`: n_shared_experts is 0
        shared = cfg.replace(intermediate_size=cfg.shared_expert_intermediate_size)
        self.shared_expert = GatedMLP(shared, dtype=dtype, rngs=rngs)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:  # [T, D] -> [T, D]
        return super().__call__(x) + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


@dataclass(frozen=True)
class Qwen2MoeConfig(SharedExpertMoEConfig, Qwen2Config):
    norm_topk_prob: bool = False  # Hugging Face's Qwen2MoeConfig default

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        check_all_layers_sparse("Qwen2-MoE", hf)
        # Unlike Qwen2's, its q/k/v biases follow `qkv_bias` (on by default).
        return {**super().fields_from_hf(hf), "attention_bias": bool(hf.get("qkv_bias", True))}


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    mlp_class = GatedSharedExpertMoeBlock


class Qwen2MoeForCausalLM(MoEForCausalLM):
    config_class = Qwen2MoeConfig
    layer_class = Qwen2MoeDecoderLayer
