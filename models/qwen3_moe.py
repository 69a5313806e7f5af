"""Qwen3-MoE (30B-A3B, 235B-A22B): the Qwen3 layer (q/k RMSNorm) with a sparse mixture of experts.

Softmax over the experts, top k, renormalized when `norm_topk_prob`; no shared experts. Every
layer is sparse in the released models; a config with dense layers among them (`mlp_only_layers`,
`decoder_sparse_step` > 1) would need a second layer stack and is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from xlaserve.models.moe import MoEConfig, MoEForCausalLM, check_all_layers_sparse
from xlaserve.models.qwen import Qwen3Config


@dataclass(frozen=True)
class Qwen3MoeConfig(MoEConfig, Qwen3Config):
    """Qwen3's reading of config.json (q/k norms, Qwen's sliding layers) plus the MoE routing."""

    norm_topk_prob: bool = False  # Hugging Face's Qwen3MoeConfig default
    family: ClassVar[str] = "Qwen3-MoE"  # as a refusal names it (a family built on this config: its own)

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        check_all_layers_sparse(cls.family, hf)
        return {**super().fields_from_hf(hf), "num_experts": hf.get("num_experts") or hf["num_local_experts"]}


class Qwen3MoeForCausalLM(MoEForCausalLM):
    config_class = Qwen3MoeConfig
