"""GLM-4.5, 4.6 and 4.7 (Glm4MoeForCausalLM, zai-org): Llama's grouped-query attention over DeepSeek
V3's mixture of experts.

Attention: biases on q, k and v (`attention_bias`; o_proj has none), RoPE on the first
`partial_rotary_factor` of each head (0.5 when config.json omits it, as Hugging Face's default is;
rotate-half pairs), and with `use_qk_norm` an RMSNorm over each head of q and k before RoPE.
MLP: the first `first_k_dense_replace` layers dense, the rest DeepSeek V3's routing (sigmoid scores,
a learned correction bias for the choice, groups scored by their best two experts) over the routed
experts plus the shared experts every token goes through; two layer stacks, as DeepSeek's. The
checkpoint's MTP layers are stored as DeepSeek V3's, past the decoder's (models/mtp.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flax import nnx

from xlaserve.kernels import AttentionBackend
from xlaserve.models.deepseek import LeadingDenseLayers, deepseek_moe_fields, v3_routing_fields
from xlaserve.models.llama import LlamaDecoderLayer
from xlaserve.models.moe import MoEConfig, MoEDecoderLayer, MoEForCausalLM


@dataclass(frozen=True)
class Glm4MoeConfig(MoEConfig):
    first_k_dense_replace: int = 0

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        fields = super().fields_from_hf(hf)
        if "partial_rotary_factor" not in {**hf, **(hf.get("rope_parameters") or {})}:
            fields["partial_rotary_factor"] = 0.5  # Hugging Face's Glm4MoeConfig default
        return {
            **fields,
            **deepseek_moe_fields(hf, shared_default=1, dense_default=1),  # Glm4MoeConfig's defaults
            **v3_routing_fields(hf),
            "attention_out_bias": False,
            "qk_norm": bool(hf.get("use_qk_norm", False)),
        }


class Glm4MoeForCausalLM(LeadingDenseLayers, MoEForCausalLM):
    """The Llama backbone over a stack of dense layers, then one of MoE layers."""

    config_class = Glm4MoeConfig

    @classmethod
    def layer_classes(cls) -> tuple[type[nnx.Module], ...]:
        return (LlamaDecoderLayer, MoEDecoderLayer)

    @classmethod
    def make_layer(
        cls, cfg: Glm4MoeConfig, backend: AttentionBackend, stack: str, *, dtype, rngs: nnx.Rngs
    ) -> LlamaDecoderLayer:
        layer_class = MoEDecoderLayer if stack == "moe_layers" else LlamaDecoderLayer
        return layer_class(cfg, backend, dtype=dtype, rngs=rngs)
