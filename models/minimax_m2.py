"""MiniMax-M2 and M2.1 (MiniMaxM2ForCausalLM): OLMoE's attention with partial RoPE, DeepSeek V3's
biased sigmoid router without its groups, in Llama's pre-norm layer.

Where it differs from Mixtral:
- q and k are each normed over their whole projection (every head together, `q_norm` of
  num_heads * head_dim: `qk_norm_type` "per_layer"), before they are split into heads and rotated:
  OLMo's attention (models/olmo.py). Under tensor parallelism the norm's mean is over the sharded
  heads, which XLA sums across ranks; KV heads copied for a wide TP copy k_norm's weight with them
  (sharding/kv_heads.py), and the mean over equal copies of every head is the mean over the heads;
- RoPE rotates the first `rotary_dim` of each head's dims (64 of 128 in the released models);
- the router scores experts by sigmoid, chooses the top k on `scores + e_score_correction_bias` and
  weighs them by their scores renormalized, with no groups, scaling or shared experts.
Checkpoints name the block `block_sparse_moe` (its bias beside the gate, not in it) and the experts'
projections w1/w3/w2, as Mixtral's do. The multi-token prediction modules a checkpoint may carry
(`num_mtp_modules` layers past num_hidden_layers) are not the decoder's and are skipped, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from xlaserve.models.mixtral import MixtralForCausalLM
from xlaserve.models.moe import MoEConfig
from xlaserve.models.olmo import OlmoeDecoderLayer


@dataclass(frozen=True)
class MiniMaxM2Config(MoEConfig):
    num_mtp_modules: int = 0  # checkpoint layers past num_hidden_layers, not the decoder's

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        if not hf.get("use_qk_norm", True) or hf.get("qk_norm_type", "per_layer") != "per_layer":
            raise ValueError(
                f"MiniMax-M2 with use_qk_norm={hf.get('use_qk_norm')}, qk_norm_type="
                f"{hf.get('qk_norm_type')!r} is not supported: q and k must be normed over all heads "
                '("per_layer"), as in the released models'
            )
        if hf.get("shared_intermediate_size"):
            raise ValueError(
                f"MiniMax-M2 with shared experts (shared_intermediate_size="
                f"{hf['shared_intermediate_size']}) is not supported"
            )
        fields = {
            **super().fields_from_hf(hf),
            "num_experts": hf["num_local_experts"],
            "scoring_func": hf.get("scoring_func") or "sigmoid",
            "has_score_correction_bias": bool(hf.get("use_routing_bias", True)),
            "norm_topk_prob": True,
            "num_mtp_modules": hf.get("num_mtp_modules") or 0,
        }
        # Released configs give `rotary_dim` and no partial_rotary_factor; transformers writes both.
        rope = hf.get("rope_parameters") or {}
        if hf.get("rotary_dim") and not (hf.get("partial_rotary_factor") or "partial_rotary_factor" in rope):
            fields["partial_rotary_factor"] = hf["rotary_dim"] / fields["head_dim"]
        return fields


class MiniMaxM2ForCausalLM(MixtralForCausalLM):
    config_class = MiniMaxM2Config
    layer_class = OlmoeDecoderLayer

    @classmethod
    def prepare_hf_tensors(
        cls, cfg: MiniMaxM2Config, tensors: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        mtp = tuple(f"model.layers.{i}." for i in range(cfg.num_layers, cfg.num_layers + cfg.num_mtp_modules))
        renamed = {
            name.replace(
                ".block_sparse_moe.e_score_correction_bias", ".block_sparse_moe.gate.e_score_correction_bias"
            ): t
            for name, t in tensors.items()
            if not name.startswith(mtp)
        }
        return super().prepare_hf_tensors(cfg, renamed)
