"""Qwen3-Next (80B-A3B) and Qwen3.5-MoE: Qwen3.5's hybrid layers (models/qwen3_5.py) with a mixture of
experts.

The mixers are Qwen3.5's: gated DeltaNet in three of every four layers, gated full attention in the
fourth. Qwen3-Next's checkpoints store the DeltaNet's projections fused per key head (`in_proj_qkvz`:
for each key head its q, k, and its value heads' v and z; `in_proj_ba`: its value heads' b and a);
`prepare_hf_tensors` regroups them into Qwen3.5's separate projections, so the layer is the same
module (Qwen3.5-MoE stores them unfused, as Qwen3.5 does). Every layer's MLP is a sparse mixture:
softmax routing over the experts, top k, renormalized when `norm_topk_prob`, plus a shared expert
scaled by sigmoid(shared_expert_gate(x)) per token (Qwen2-MoE's block, models/qwen2_moe.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from xlaserve.models.moe import check_all_layers_sparse, stack_expert_tensors
from xlaserve.models.qwen2_moe import GatedSharedExpertMoeBlock, SharedExpertMoEConfig
from xlaserve.models.qwen3_5 import (
    Qwen3_5AttentionLayer,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5LinearLayer,
)

_FUSED_DELTANET = re.compile(r"^(?P<layer>.+\.layers\.\d+\.linear_attn)\.in_proj_(?P<which>qkvz|ba)\.weight$")


@dataclass(frozen=True)
class Qwen3NextConfig(SharedExpertMoEConfig, Qwen3_5Config):
    """Qwen3.5's hybrid layers plus the MoE routing and the gated shared expert's width."""

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        check_all_layers_sparse("Qwen3-Next", hf)
        return super().fields_from_hf(hf)


class Qwen3NextLinearLayer(Qwen3_5LinearLayer):
    mlp_class = GatedSharedExpertMoeBlock


class Qwen3NextAttentionLayer(Qwen3_5AttentionLayer):
    mlp_class = GatedSharedExpertMoeBlock


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    config_class = Qwen3NextConfig
    linear_layer_class = Qwen3NextLinearLayer
    attention_layer_class = Qwen3NextAttentionLayer

    @classmethod
    def prepare_hf_tensors(
        cls, cfg: Qwen3NextConfig, tensors: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """The fused DeltaNet projections regrouped as Qwen3.5's; the experts stacked."""
        out = {}
        for name, tensor in tensors.items():
            m = _FUSED_DELTANET.match(name)
            if m is None:
                out[name] = tensor
            elif m["which"] == "qkvz":
                qkv, z = _split_qkvz(cfg, np.asarray(tensor))
                out[f"{m['layer']}.in_proj_qkv.weight"], out[f"{m['layer']}.in_proj_z.weight"] = qkv, z
            else:
                b, a = _split_ba(cfg, np.asarray(tensor))
                out[f"{m['layer']}.in_proj_b.weight"], out[f"{m['layer']}.in_proj_a.weight"] = b, a
        return stack_expert_tensors(super().prepare_hf_tensors(cfg, out), cfg.num_experts)


def _split_qkvz(cfg: Qwen3NextConfig, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[Hk * (2 Dk + 2 r Dv), D], per key head (q, k, v of its r value heads, z of them) -> the rows
    of q, k and v for all heads (in_proj_qkv), and of z (in_proj_z)."""
    hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    rdv = cfg.linear_num_value_heads // hk * cfg.linear_value_head_dim
    per_head = weight.reshape(hk, 2 * dk + 2 * rdv, -1)
    q, k, v, z = np.split(per_head, [dk, 2 * dk, 2 * dk + rdv], axis=1)
    flat = [part.reshape(-1, weight.shape[-1]) for part in (q, k, v, z)]
    return np.concatenate(flat[:3]), flat[3]


def _split_ba(cfg: Qwen3NextConfig, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[Hk * 2r, D], per key head (b, a of its r value heads) -> b's rows, a's rows."""
    hk = cfg.linear_num_key_heads
    r = cfg.linear_num_value_heads // hk
    b, a = np.split(weight.reshape(hk, 2 * r, -1), 2, axis=1)
    return b.reshape(-1, weight.shape[-1]), a.reshape(-1, weight.shape[-1])
