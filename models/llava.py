"""LLaVA (LlavaForConditionalGeneration): a CLIP vision tower, a two-layer projector, a Llama decoder.

An image becomes `tokens_per_image` embeddings (one per patch; the class token dropped under the
"default" feature strategy) that replace its placeholder tokens' embeddings before the decoder layers.
The vision tower and projector run as their own program (`encode_images`, jitted by the worker per
image-count bucket: worker/mm_encoder.py); the decoder is Llama's (models/llama.py), reading the
step's image rows through `mm` (models/multimodal.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.models.config import TransformerConfig
from xlaserve.models.encoder import LayerNorm, Table
from xlaserve.models.layers import Linear, activation
from xlaserve.models.llama import LlamaDecoderLayer
from xlaserve.models.multimodal import VisionLanguageLM

_ACTIVATIONS = {"quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x)}


@dataclass(frozen=True)
class VisionConfig:
    """A ViT vision tower, as config.json's `vision_config` says: CLIP's (a class token, a bias-free
    patch convolution, a norm before the layers) by default; SigLIP's (Gemma 3: no class token, a
    patch bias, a norm after the layers) with the flags below."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_layers: int  # layers run: up to the one whose output is the image's features
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"
    class_token: bool = True
    patch_bias: bool = False
    pre_norm: bool = True
    post_norm: bool = False

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class LlavaConfig(TransformerConfig):
    vision: VisionConfig | None = None
    image_token_id: int = -1
    keeps_class_token: bool = False  # vision_feature_select_strategy "full" (else "default": dropped)
    projector_act: str = "gelu"
    projector_bias: bool = True
    bidirectional_images: bool = False  # an image's tokens attend causally, as the text's

    @property
    def tokens_per_image(self) -> int:
        return self.vision.num_patches + int(self.keeps_class_token)

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        text = {**hf["text_config"], "architectures": hf.get("architectures")}
        vision = hf["vision_config"]
        layer = hf.get("vision_feature_layer", -2)
        if not isinstance(layer, int):
            raise ValueError(f"vision_feature_layer must be one layer index, got {layer!r}")
        num_vision_layers = vision["num_hidden_layers"]
        # hidden_states[0] is the embeddings, hidden_states[i] layer i's output: run `layer` layers.
        num_run = layer % (num_vision_layers + 1)
        strategy = hf.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy must be 'default' or 'full', got {strategy!r}")
        return {
            **super().fields_from_hf(text),
            "vision": VisionConfig(
                hidden_size=vision["hidden_size"],
                intermediate_size=vision["intermediate_size"],
                num_heads=vision["num_attention_heads"],
                num_layers=num_run,
                image_size=vision["image_size"],
                patch_size=vision["patch_size"],
                num_channels=vision.get("num_channels", 3),
                layer_norm_eps=vision.get("layer_norm_eps", 1e-5),
                hidden_act=vision.get("hidden_act", "quick_gelu"),
            ),
            "image_token_id": hf.get("image_token_index", hf.get("image_token_id", -1)),
            "keeps_class_token": strategy == "full",
            "projector_act": hf.get("projector_hidden_act", "gelu"),
            "projector_bias": hf.get("multimodal_projector_bias", True),
        }


def _act(name: str):
    return _ACTIVATIONS[name] if name in _ACTIVATIONS else activation(name)


class VisionEmbeddings(nnx.Module):
    def __init__(self, v: VisionConfig, *, dtype, rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(0.02)
        p = v.patch_size
        # The patch convolution's weight as HF stores it, [D, C, p, p] (a bias in SigLIP).
        conv = {"weight": nnx.Param(init(rngs.params(), (v.hidden_size, v.num_channels, p, p), dtype))}
        if v.patch_bias:
            conv["bias"] = nnx.Param(jnp.zeros((v.hidden_size,), dtype))
        self.patch_embedding = nnx.Dict(conv)
        if v.class_token:
            self.class_embedding = nnx.Param(init(rngs.params(), (v.hidden_size,), dtype))
        num_positions = v.num_patches + int(v.class_token)
        self.position_embedding = Table(num_positions, v.hidden_size, dtype=dtype, rngs=rngs)
        self.patch_size = p
        self.class_token = v.class_token

    def __call__(self, pixels: jax.Array) -> jax.Array:  # [B, C, H, W] -> [B, (1 +) P, D]
        b, c, h, w = pixels.shape
        p = self.patch_size
        patches = pixels.reshape(b, c, h // p, p, w // p, p).transpose(0, 2, 4, 1, 3, 5)
        patches = patches.reshape(b, (h // p) * (w // p), c * p * p)  # [B, P, C*p*p], row-major patches
        kernel = self.patch_embedding["weight"][...].reshape(-1, c * p * p)  # [D, C*p*p]
        x = jnp.einsum("bpk,dk->bpd", patches.astype(kernel.dtype), kernel)
        if "bias" in self.patch_embedding:
            x = x + self.patch_embedding["bias"][...]
        if self.class_token:
            cls = jnp.broadcast_to(self.class_embedding[...], (b, 1, x.shape[-1]))
            x = jnp.concatenate([cls, x], axis=1)
        return x + self.position_embedding.weight[...][None]


class VisionAttention(nnx.Module):
    def __init__(self, v: VisionConfig, *, dtype, rngs: nnx.Rngs):
        d = v.hidden_size
        self.q_proj = Linear(d, d, use_bias=True, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(d, d, use_bias=True, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(d, d, use_bias=True, dtype=dtype, rngs=rngs)
        self.out_proj = Linear(d, d, use_bias=True, dtype=dtype, rngs=rngs)
        self.num_heads = v.num_heads

    def __call__(self, x: jax.Array) -> jax.Array:  # [B, S, D], every token sees every token
        b, s, d = x.shape
        shape = (b, s, self.num_heads, d // self.num_heads)
        q, k, v = (proj(x).reshape(shape) for proj in (self.q_proj, self.k_proj, self.v_proj))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        probs = jax.nn.softmax(scores * shape[-1] ** -0.5, axis=-1).astype(v.dtype)
        return self.out_proj(jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d))


class VisionLayer(nnx.Module):
    """CLIP's pre-norm layer: x + attn(ln1(x)), then x + fc2(act(fc1(ln2(x))))."""

    def __init__(self, v: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.layer_norm1 = LayerNorm(v.hidden_size, v.layer_norm_eps, dtype=dtype)
        self.self_attn = VisionAttention(v, dtype=dtype, rngs=rngs)
        self.layer_norm2 = LayerNorm(v.hidden_size, v.layer_norm_eps, dtype=dtype)
        self.mlp = nnx.Dict(
            fc1=Linear(v.hidden_size, v.intermediate_size, use_bias=True, dtype=dtype, rngs=rngs),
            fc2=Linear(v.intermediate_size, v.hidden_size, use_bias=True, dtype=dtype, rngs=rngs),
        )
        self.act = _act(v.hidden_act)

    def __call__(self, x: jax.Array) -> jax.Array:  # [B, S, D]
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp["fc2"](self.act(self.mlp["fc1"](self.layer_norm2(x))))


class VisionTower(nnx.Module):
    """The vision transformer up to the feature layer: CLIP's (later layers and the post-norm unused)
    or SigLIP's (every layer, then the post-norm)."""

    def __init__(self, v: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.embeddings = VisionEmbeddings(v, dtype=dtype, rngs=rngs)
        if v.pre_norm:
            self.pre_layrnorm = LayerNorm(v.hidden_size, v.layer_norm_eps, dtype=dtype)  # HF's spelling
        self.layers = nnx.List([VisionLayer(v, dtype=dtype, rngs=rngs) for _ in range(v.num_layers)])
        if v.post_norm:
            self.post_layernorm = LayerNorm(v.hidden_size, v.layer_norm_eps, dtype=dtype)
        self.pre_norm, self.post_norm = v.pre_norm, v.post_norm

    def __call__(self, pixels: jax.Array) -> jax.Array:  # [B, C, H, W] -> [B, (1 +) P, D]
        x = self.embeddings(pixels)
        if self.pre_norm:
            x = self.pre_layrnorm(x)
        for layer in self.layers:  # a few layers of one small program: unrolled
            x = layer(x)
        return self.post_layernorm(x) if self.post_norm else x


class LlavaForConditionalGeneration(VisionLanguageLM):
    config_class = LlavaConfig
    layer_class = LlamaDecoderLayer
    encoder_modules = ("vision_tower", "multi_modal_projector")

    def __init__(self, cfg: LlavaConfig, backend, *, dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(cfg, backend, dtype=dtype, rngs=rngs)
        v = cfg.vision
        self.vision_tower = VisionTower(v, dtype=dtype, rngs=rngs)
        bias = cfg.projector_bias
        self.multi_modal_projector = nnx.Dict(
            linear_1=Linear(v.hidden_size, cfg.hidden_size, use_bias=bias, dtype=dtype, rngs=rngs),
            linear_2=Linear(cfg.hidden_size, cfg.hidden_size, use_bias=bias, dtype=dtype, rngs=rngs),
        )

    @classmethod
    def prepare_hf_tensors(cls, cfg: LlavaConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """HF's names (transformers 5's `model.language_model.*`, or 4's `language_model.model.*`) as
        ours; the vision layers past the feature layer and the post-norm are dropped (never run)."""
        out = {}
        for name, tensor in tensors.items():
            name = vision_language_tensor_name(name)
            if _is_unused_vision(name, cfg.vision.num_layers):
                continue
            out[name] = tensor
        return out

    def encode_images(self, pixels: jax.Array) -> jax.Array:  # [B, C, H, W] -> [B, N, D_text]
        """The image embeddings that replace the placeholders: tower features, then the projector."""
        cfg = self.cfg
        features = self.vision_tower(pixels)
        if not cfg.keeps_class_token:
            features = features[:, 1:]
        proj = self.multi_modal_projector
        return proj["linear_2"](_act(cfg.projector_act)(proj["linear_1"](features)))


_RENAMES = (  # (HF prefix, ours), first match wins: transformers 5 in memory, then as saved (4's layout)
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.vision_model.", "model.vision_tower."),
    ("vision_tower.vision_model.", "model.vision_tower."),
    ("model.vision_tower.", "model.vision_tower."),
    ("vision_tower.", "model.vision_tower."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
)


def vision_language_tensor_name(name: str) -> str:
    """A LLaVA-layout checkpoint's tensor name (Gemma 3's too) as ours: the decoder under `model.`, the
    vision tower and projector under `model.vision_tower.` and `model.multi_modal_projector.`."""
    for prefix, ours in _RENAMES:
        if name.startswith(prefix):
            name = ours + name[len(prefix) :]
            break
    return name.replace("model.vision_tower.encoder.layers.", "model.vision_tower.layers.")


def _is_unused_vision(name: str, num_layers: int) -> bool:
    if name.startswith("model.vision_tower.post_layernorm."):
        return True
    prefix = "model.vision_tower.layers."
    return name.startswith(prefix) and int(name[len(prefix) :].split(".")[0]) >= num_layers


def tokens_per_image(cfg: TransformerConfig) -> int:
    """Encoder output rows per image of a vision-language config (0: a text-only model)."""
    return cfg.tokens_per_image if getattr(cfg, "vision", None) is not None else 0
