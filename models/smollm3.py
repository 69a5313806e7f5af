"""SmolLM3 (SmolLM3ForCausalLM): the Llama layer, with no RoPE on some layers (NoPE).

`no_rope_layers` gives each layer a 1 (rotated) or 0 (not: every fourth by default); those layers'
RoPE frequencies are zero (models/rope.py), which the shared `Attention` reads as "keep q and k as they
are", inside the one layer scan; the other layers share one cos/sin computed once per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from xlaserve.models.config import TransformerConfig
from xlaserve.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class SmolLM3Config(TransformerConfig):
    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        rotated = hf.get("no_rope_layers") or []
        return {**super().fields_from_hf(hf), "nope_layers": tuple(i for i, r in enumerate(rotated) if not r)}


class SmolLM3ForCausalLM(LlamaForCausalLM):
    config_class = SmolLM3Config
