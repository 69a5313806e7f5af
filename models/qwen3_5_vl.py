"""Qwen3.5 and Qwen3.5-MoE with images and videos (`Qwen3_5ForConditionalGeneration`,
`Qwen3_5MoeForConditionalGeneration`: the checkpoint every Qwen3.5 size ships as).

Qwen3-VL's way with images (models/qwen3_vl.py: its tower, each image at its own size, M-RoPE with
the streams interleaved over the frequencies, videos as frame pairs with their times in the text)
without DeepStack, in front of the hybrid decoder of models/qwen3_5.py (Gated DeltaNet layers beside
gated attention layers; Qwen3.5-MoE's: models/qwen3_next.py). Only the attention layers rotate, by
the step's M-RoPE positions over their partial rotary dimensions; the DeltaNet layers read the merged
embeddings as they read text. The multi-token prediction layer (`mtp.*`) is the decoder's drafter
(models/mtp.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.models.qwen2_5_vl import QwenImageFields, QwenVisionLanguageLM, image_fields, text_config
from xlaserve.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForCausalLM
from xlaserve.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM
from xlaserve.models.qwen3_vl import InterleavedMRoPE, VisionTower, qwen3_vision_config

_MROPE_SECTION = (11, 11, 10)  # the releases' (transformers' default): 32 frequencies of a 64-dim rotation


def _vision_language_fields(text_fields, hf: dict[str, Any]) -> dict[str, Any]:
    """The decoder's fields (`text_fields` of the text config) and the tower's, which has no DeepStack."""
    vision = {**hf["vision_config"], "deepstack_visual_indexes": ()}
    return {
        **text_fields(text_config(hf)),
        **image_fields(hf, _MROPE_SECTION),
        "vision": qwen3_vision_config(vision),
    }


@dataclass(frozen=True)
class Qwen3_5VLConfig(InterleavedMRoPE, QwenImageFields, Qwen3_5Config):
    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        return _vision_language_fields(super().fields_from_hf, hf)


@dataclass(frozen=True)
class Qwen3_5MoeVLConfig(InterleavedMRoPE, QwenImageFields, Qwen3NextConfig):
    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        return _vision_language_fields(super().fields_from_hf, hf)


class _Qwen3_5VisionLanguageLM(QwenVisionLanguageLM):
    """The tower beside a hybrid decoder (`text_class`, the next base class): the forward is
    `VisionLanguageLM`'s over the hybrid backbone's `run_layers`."""

    text_class: ClassVar[type]

    def __init__(self, cfg, backend, *, dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(cfg, backend, dtype=dtype, rngs=rngs)
        self.visual = VisionTower(cfg.vision, dtype=dtype, rngs=rngs)

    @classmethod
    def prepare_hf_tensors(cls, cfg, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The Qwen VL names (`QwenVisionLanguageLM`'s), then the decoder's own rewriting."""
        return cls.text_class.prepare_hf_tensors(cfg, QwenVisionLanguageLM.prepare_hf_tensors(cfg, tensors))


class Qwen3_5ForConditionalGeneration(_Qwen3_5VisionLanguageLM, Qwen3_5ForCausalLM):
    config_class = Qwen3_5VLConfig
    text_class = Qwen3_5ForCausalLM


class Qwen3_5MoeForConditionalGeneration(_Qwen3_5VisionLanguageLM, Qwen3NextForCausalLM):
    config_class = Qwen3_5MoeVLConfig
    text_class = Qwen3NextForCausalLM
