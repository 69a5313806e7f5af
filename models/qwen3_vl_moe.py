"""Qwen3-VL-MoE (Qwen3VLMoeForConditionalGeneration: Qwen3-VL-30B-A3B, 235B-A22B): Qwen3-VL with a
sparse mixture of experts in every decoder layer.

Everything but the decoder's MLP is Qwen3-VL's (models/qwen3_vl.py: the tower, DeepStack, interleaved
M-RoPE, videos as frame pairs); the MLP is Qwen3-MoE's block (models/moe.py: softmax over the experts,
top k), its top-k weights always renormalized (Hugging Face's router has no `norm_topk_prob`). The
releases store each layer's experts fused and ready for a batched matmul, `experts.gate_up_proj`
[E, D, 2F] (gate columns, then up) and `experts.down_proj` [E, F, D]; transformers 5 keeps (and saves)
them transposed, [E, 2F, D] and [E, D, F], and reads either by shape, as this loader does. Tensor and
expert parallelism split the decoder as Qwen3-MoE's and the tower as Qwen3-VL's (sharding/rules.py
names the parameters, not the family).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from xlaserve.models.moe import MoEDecoderLayer, stack_expert_tensors
from xlaserve.models.qwen3_moe import Qwen3MoeConfig
from xlaserve.models.qwen3_vl import Qwen3VLConfig, Qwen3VLForConditionalGeneration
from xlaserve.models.safetensors_loader import CheckpointTensor


@dataclass(frozen=True)
class Qwen3VLMoeConfig(Qwen3VLConfig, Qwen3MoeConfig):
    """Qwen3-VL's reading of config.json (its text_config through Qwen3-MoE's, the experts' fields)."""

    norm_topk_prob: bool = True
    family: ClassVar[str] = "Qwen3-VL-MoE"

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        return {**super().fields_from_hf(hf), "norm_topk_prob": True}


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    config_class = Qwen3VLMoeConfig
    layer_class = MoEDecoderLayer

    @classmethod
    def prepare_hf_tensors(
        cls, cfg: Qwen3VLMoeConfig, tensors: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """The Qwen VL names, the releases' fused experts as transformers 5's, then the experts stacked
        (a checkpoint's per-expert tensors too)."""
        d, f = cfg.hidden_size, cfg.moe_intermediate_size
        transformers_shapes = {"gate_up_proj": (2 * f, d), "down_proj": (d, f)}
        out = {}
        for name, tensor in super().prepare_hf_tensors(cfg, tensors).items():
            proj = name.rpartition(".experts.")[2]
            # A square one (D = 2F, or D = F) reads as transformers', as its loader reads it.
            is_release = proj in transformers_shapes and tuple(tensor.shape[1:]) != transformers_shapes[proj]
            out[name] = _swap_last_axes(tensor) if is_release else tensor
        return stack_expert_tensors(out, cfg.num_experts)


def _swap_last_axes(tensor):
    """[E, a, b] -> [E, b, a]; a checkpoint's tensor when read (a view of what it reads)."""
    if not isinstance(tensor, CheckpointTensor):
        return np.swapaxes(tensor, -1, -2)
    shape = (*tensor.shape[:-2], tensor.shape[-1], tensor.shape[-2])
    return tensor.derived(lambda array: np.swapaxes(array, -1, -2), shape)
