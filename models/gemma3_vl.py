"""Gemma 3 with images (Gemma3ForConditionalGeneration): a SigLIP vision tower, a pooled projector and
the Gemma 3 decoder (models/gemma.py), whose image tokens attend to their whole image.

An image becomes `mm_tokens_per_image` embeddings: the tower's patch features, average-pooled in
square windows to that many, RMS-normed ((1 + w), Gemma's) and projected to the decoder's width by a
plain matrix. They replace the image's `<image_soft_token>` embeddings after the decoder's embedding
scale (Hugging Face scales the token embeddings only). In the decoder, an image's tokens see each
other both ways (Hugging Face's mask with the processor's `token_type_ids`): the worker sends, per
token, how far past its own position it sees (`AttentionMetadata.attend_ahead`: worker/mm_encoder.py),
and the scheduler never ends a chunk inside an image (core/encoder_cache_manager.py `fit`), so every
image's keys are written in the step that reads them. The reference attention and the Pallas kernel
serve it (not the Triton kernel, nor context parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.kernels import AttentionBackend
from xlaserve.models.gemma import Gemma3Config, GemmaDecoderLayer
from xlaserve.models.layers import RMSNorm
from xlaserve.models.llava import VisionConfig, VisionTower, vision_language_tensor_name
from xlaserve.models.multimodal import VisionLanguageLM


@dataclass(frozen=True)
class Gemma3VisionLanguageConfig(Gemma3Config):
    vision: VisionConfig | None = None
    image_token_id: int = -1
    mm_tokens_per_image: int = 256
    # Image tokens attend to every token of their image (the worker sends `attend_ahead`).
    bidirectional_images: bool = True

    @property
    def tokens_per_image(self) -> int:
        return self.mm_tokens_per_image

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        text = {**hf["text_config"], "architectures": hf.get("architectures")}
        vision = hf["vision_config"]
        patches_per_side = vision["image_size"] // vision["patch_size"]
        tokens = hf.get("mm_tokens_per_image", 256)
        side = int(round(tokens**0.5))
        if side * side != tokens or patches_per_side % side:
            raise ValueError(
                f"mm_tokens_per_image must be a square whose side divides the {patches_per_side} patches "
                f"per side, got {tokens}"
            )
        return {
            **super().fields_from_hf(text),
            "vision": VisionConfig(
                hidden_size=vision["hidden_size"],
                intermediate_size=vision["intermediate_size"],
                num_heads=vision["num_attention_heads"],
                num_layers=vision["num_hidden_layers"],
                image_size=vision["image_size"],
                patch_size=vision["patch_size"],
                num_channels=vision.get("num_channels", 3),
                layer_norm_eps=vision.get("layer_norm_eps", 1e-6),
                hidden_act=vision.get("hidden_act", "gelu_pytorch_tanh"),
                class_token=False,
                patch_bias=True,
                pre_norm=False,
                post_norm=True,
            ),
            "image_token_id": hf.get("image_token_index", hf.get("image_token_id", -1)),
            "mm_tokens_per_image": tokens,
        }


class Gemma3ForConditionalGeneration(VisionLanguageLM):
    config_class = Gemma3VisionLanguageConfig
    layer_class = GemmaDecoderLayer
    encoder_modules = ("vision_tower", "multi_modal_projector")

    def __init__(
        self, cfg: Gemma3VisionLanguageConfig, backend: AttentionBackend, *, dtype=jnp.float32, rngs
    ):
        if not backend.serves_attend_ahead:
            raise ValueError(
                f"attention_backend {backend.name!r} does not serve Gemma 3's images (their tokens attend "
                "both ways within an image; this attention is causal only): use 'reference' or 'pallas'"
            )
        super().__init__(cfg, backend, dtype=dtype, rngs=rngs)
        v = cfg.vision
        self.vision_tower = VisionTower(v, dtype=dtype, rngs=rngs)
        self.multi_modal_projector = nnx.Dict(
            mm_input_projection_weight=nnx.Param(jnp.zeros((v.hidden_size, cfg.hidden_size), dtype)),
            mm_soft_emb_norm=RMSNorm(v.hidden_size, v.layer_norm_eps, offset=1.0, dtype=dtype),
        )

    @classmethod
    def prepare_hf_tensors(cls, cfg, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """HF's names (transformers 5's `model.language_model.*` or the saved `language_model.model.*`;
        the tower under `vision_tower.vision_model.` or `vision_tower.`) as ours; SigLIP's pooling head
        (never run: Gemma 3 pools the patches itself) is dropped."""
        out = {}
        for name, tensor in tensors.items():
            name = vision_language_tensor_name(name)
            if name.startswith("model.vision_tower.head."):
                continue
            out[name] = tensor
        return out

    def encode_images(self, pixels: jax.Array) -> jax.Array:  # [B, C, H, W] -> [B, N, D_text]
        """The tower's patch features pooled to `mm_tokens_per_image`, normed and projected."""
        cfg = self.cfg
        features = self.vision_tower(pixels)  # [B, P, Dv], patches row-major
        b, num_patches, dv = features.shape
        side = int(round(num_patches**0.5))
        out_side = int(round(cfg.mm_tokens_per_image**0.5))
        k = side // out_side
        pooled = features.astype(jnp.float32).reshape(b, out_side, k, out_side, k, dv).mean(axis=(2, 4))
        pooled = pooled.reshape(b, out_side * out_side, dv).astype(features.dtype)
        proj = self.multi_modal_projector
        normed = proj["mm_soft_emb_norm"](pooled)
        weight = proj["mm_input_projection_weight"][...]
        return jnp.einsum("bnv,vd->bnd", normed, weight, preferred_element_type=jnp.float32).astype(
            weight.dtype
        )
