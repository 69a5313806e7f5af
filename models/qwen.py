"""Qwen2 / Qwen2.5 and Qwen3 (dense): the Llama layer with Qwen's attention changes.

Qwen2: biases on the q/k/v projections (none on o_proj), whatever `attention_bias` says. Qwen3: an
RMSNorm over each head of q and k before RoPE. Both may slide a window on the layers from
`max_window_layers` on, when `use_sliding_window` is set. The shared `Attention` reads it all from
the config; these config classes are where it is read from config.json.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from xlaserve.models.config import TransformerConfig
from xlaserve.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class QwenConfig(TransformerConfig):
    """Qwen's sliding window: off unless `use_sliding_window` (its config.json carries a size
    regardless); without `layer_types`, the layers from `max_window_layers` on slide."""

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        fields = super().fields_from_hf(hf)
        if hf.get("use_sliding_window") is False:
            fields.update(sliding_window=None, layer_types=())
        return fields

    @classmethod
    def default_sliding_layers(cls, hf: dict[str, Any], num_layers: int) -> list[bool]:
        return [i >= hf.get("max_window_layers", 0) for i in range(num_layers)]


@dataclass(frozen=True)
class Qwen2Config(QwenConfig):
    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        # Hugging Face's Qwen2 hard-codes the q/k/v biases instead of reading attention_bias.
        return {**super().fields_from_hf(hf), "attention_bias": True, "attention_out_bias": False}


@dataclass(frozen=True)
class Qwen3Config(QwenConfig):
    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        return {**super().fields_from_hf(hf), "qk_norm": True}


class Qwen2ForCausalLM(LlamaForCausalLM):
    config_class = Qwen2Config


class Qwen3ForCausalLM(LlamaForCausalLM):
    config_class = Qwen3Config
