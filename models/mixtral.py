"""Mixtral (8x7B, 8x22B): the Mistral layer with a sparse mixture of experts as its MLP.

Softmax over the experts, top k, weights renormalized over the chosen ones; no shared experts.
Checkpoints name the block `block_sparse_moe` and the experts' projections w1 (gate), w3 (up),
w2 (down); we read them into the shared MoE block's stacked layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from xlaserve.models.moe import MoEConfig, MoEForCausalLM


@dataclass(frozen=True)
class MixtralConfig(MoEConfig):
    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        return {
            **super().fields_from_hf(hf),
            "num_experts": hf["num_local_experts"],
            "moe_intermediate_size": hf["intermediate_size"],  # each expert is a full-width MLP
            "norm_topk_prob": True,
        }


class MixtralForCausalLM(MoEForCausalLM):
    config_class = MixtralConfig

    @classmethod
    def prepare_hf_tensors(cls, cfg: MixtralConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        renamed = {name.replace(".block_sparse_moe.", ".mlp."): t for name, t in tensors.items()}
        return super().prepare_hf_tensors(cfg, renamed)
