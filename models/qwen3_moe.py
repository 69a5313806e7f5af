"""Qwen3-MoE (30B-A3B, 235B-A22B): the Qwen3 layer (q/k RMSNorm) with a sparse mixture of experts.

Softmax over the experts, top k, renormalized when `norm_topk_prob`; no shared experts. Every
layer is sparse in the released models; a config with dense layers among them (`mlp_only_layers`,
`decoder_sparse_step` > 1) would need a second layer stack and is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from xlaserve.models.config import TransformerConfig
from xlaserve.models.llama import LlamaForCausalLM
from xlaserve.models.moe import MoEConfig, MoEDecoderLayer, config_with, stack_expert_tensors


@dataclass(frozen=True)
class Qwen3MoeConfig(MoEConfig):
    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Qwen3MoeConfig:
        if hf.get("mlp_only_layers") or (hf.get("decoder_sparse_step") or 1) != 1:
            raise ValueError(
                "Qwen3-MoE with dense layers (mlp_only_layers="
                f"{hf.get('mlp_only_layers')}, decoder_sparse_step={hf.get('decoder_sparse_step')}) is not "
                "supported: every layer must be sparse"
            )
        num_experts = hf.get("num_experts") or hf["num_local_experts"]
        fields = MoEConfig.moe_fields_from_hf(hf, norm_topk_prob=False)
        return config_with(
            TransformerConfig.from_hf(hf), cls, qk_norm=True, num_experts=num_experts, **fields
        )


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    config_class = Qwen3MoeConfig
    layer_class = MoEDecoderLayer

    @staticmethod
    def prepare_hf_tensors(cfg: Qwen3MoeConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return stack_expert_tensors(tensors, cfg.num_experts)
