"""Qwen3-VL (Qwen3VLForConditionalGeneration): Qwen2.5-VL's way with images (each at its own size, patches
packed per bucket: models/qwen_vl_tower.py; M-RoPE: models/qwen2_5_vl.py), with a plainer tower and DeepStack.

The tower: a patch matrix with a bias, a learned 2-D position table resampled (bilinear, corners aligned)
to each image's patch grid (the host gives each patch its four taps and weights), LayerNorm blocks with a
plain GELU MLP, every block attending to the whole image. DeepStack: the patch features after a few
blocks (`deepstack_visual_indexes`) each go through a merger of their own, and the decoder adds them to
the image tokens' hidden states after its first layers (one feature per layer). So the encoder cache
holds, per image token, the token's embedding and then one deepstack feature per such layer
(`encoder_output_width`), and the step adds feature i after layer i (`after_layer`). The decoder is
Qwen3's, its M-RoPE frequencies interleaved (t, h, w, t, h, w, ...) instead of in sections.

Videos: each frame pair's time is text between the pairs (`<0.2 seconds>`, the front end's), so the front
end makes each pair a feature of its own with a (1, h, w) grid: the tower encodes it as an image (Hugging
Face's cu_seqlens and position table are per pair too), it takes its M-RoPE block as an image does
(get_rope_index splits a video's grid into pairs), and DeepStack adds to its tokens as to an image's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.models.encoder import LayerNorm, Table
from xlaserve.models.layers import Linear, activation
from xlaserve.models.llama import LlamaDecoderLayer
from xlaserve.models.multimodal import EncoderOutputs
from xlaserve.models.qwen import Qwen3Config
from xlaserve.models.qwen2_5_vl import QwenImageFields, QwenVisionLanguageLM, image_fields, text_config
from xlaserve.models.qwen_vl_tower import (
    PatchAttention,
    QwenVisionConfig,
    pack_images,
    vision_fields,
    vision_rope,
)


@dataclass(frozen=True)
class Qwen3VisionConfig(QwenVisionConfig):
    num_position_embeddings: int = 2304  # a square table of learned positions
    deepstack_visual_indexes: tuple[int, ...] = ()

    def pack(self, images: list, bucket: int) -> dict[str, np.ndarray]:
        """Qwen2.5-VL's packing (every block attends to the whole image, so the window order is only
        an order), and each patch's four taps into the position table with their weights."""
        packed = pack_images(self, images, bucket)
        side = int(round(self.num_position_embeddings**0.5))
        sizes = np.array([(h, w) for (t, h, w), _, _ in images for _ in range(t)] or [(1, 1)], np.int64)
        size = sizes[np.maximum(packed["image_ids"], 0)]  # [P, 2] each patch's grid (h, w), by frame
        row_taps, row_weights = _bilinear_taps(packed["pos"][:, 0], size[:, 0], side)
        col_taps, col_weights = _bilinear_taps(packed["pos"][:, 1], size[:, 1], side)
        packed["pos_taps"] = (
            (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4).astype(np.int32)
        )
        packed["pos_weights"] = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4)
        return packed


def _bilinear_taps(index: np.ndarray, size: np.ndarray, side: int) -> tuple[np.ndarray, np.ndarray]:
    """The two table rows a position `index` of an axis of `size` reads when a `side`-long table is
    resized to it (bilinear, corners aligned: 0 -> 0, size - 1 -> side - 1), and their weights."""
    source = index * (side - 1) / np.maximum(size - 1, 1)
    floor = np.floor(source)
    taps = floor[:, None] + np.arange(2)  # floor, floor + 1
    weights = np.clip(1 - np.abs(source[:, None] - taps), 0, None).astype(np.float32)
    return np.clip(taps, 0, side - 1).astype(np.int64), weights


class InterleavedMRoPE:
    """Qwen3-VL's and Qwen3.5's M-RoPE: the position streams interleaved over the frequencies."""

    @property
    def mrope_streams(self) -> np.ndarray:
        """Frequency j turns by h where j % 3 == 1 and by w where j % 3 == 2, within 3 x its section;
        every other frequency by t."""
        j = np.arange(self.rotary_dim // 2)
        streams = np.zeros_like(j)
        for stream in (1, 2):
            streams[(j % 3 == stream) & (j < 3 * self.mrope_section[stream])] = stream
        return streams


def qwen3_vision_config(vision: dict[str, Any]) -> Qwen3VisionConfig:
    """config.json's vision_config of Qwen3-VL's tower (Qwen3.5's: the same without DeepStack)."""
    return Qwen3VisionConfig(
        **{**vision_fields(vision), "hidden_act": vision.get("hidden_act", "gelu_pytorch_tanh")},
        window_size=1 << 30,  # no windows: one window an image
        fullatt_block_indexes=tuple(range(vision["depth"])),
        num_position_embeddings=vision.get("num_position_embeddings", 2304),
        deepstack_visual_indexes=tuple(vision.get("deepstack_visual_indexes", ())),
    )


@dataclass(frozen=True)
class Qwen3VLConfig(InterleavedMRoPE, QwenImageFields, Qwen3Config):
    @property
    def encoder_output_width(self) -> int:
        return self.hidden_size * (1 + len(self.vision.deepstack_visual_indexes))

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        return {
            **super().fields_from_hf(text_config(hf)),
            **image_fields(hf, (24, 20, 20)),
            "vision": qwen3_vision_config(hf["vision_config"]),
        }


class Merger(nnx.Module):
    """Four patches -> one token of the decoder's width: a LayerNorm over each patch (the final merger)
    or over the four together (DeepStack's), then two matrices around a GELU."""

    def __init__(self, v: Qwen3VisionConfig, *, after_shuffle: bool, dtype, rngs: nnx.Rngs):
        merged = v.hidden_size * v.merge_unit
        self.norm = LayerNorm(merged if after_shuffle else v.hidden_size, 1e-6, dtype=dtype)
        self.linear_fc1 = Linear(merged, merged, use_bias=True, dtype=dtype, rngs=rngs)
        self.linear_fc2 = Linear(merged, v.out_hidden_size, use_bias=True, dtype=dtype, rngs=rngs)
        self.after_shuffle, self.merged = after_shuffle, merged

    def __call__(self, x: jax.Array) -> jax.Array:  # [P, D] -> [P / 4, D_text]
        x = (
            self.norm(x.reshape(-1, self.merged))
            if self.after_shuffle
            else self.norm(x).reshape(-1, self.merged)
        )
        return self.linear_fc2(jax.nn.gelu(self.linear_fc1(x), approximate=False))


class VisionBlock(nnx.Module):
    def __init__(self, v: Qwen3VisionConfig, *, dtype, rngs: nnx.Rngs):
        d = v.hidden_size
        self.norm1 = LayerNorm(d, 1e-6, dtype=dtype)
        self.norm2 = LayerNorm(d, 1e-6, dtype=dtype)
        self.attn = PatchAttention(d, v.num_heads, dtype=dtype, rngs=rngs)
        self.mlp = nnx.Dict(
            linear_fc1=Linear(d, v.intermediate_size, use_bias=True, dtype=dtype, rngs=rngs),
            linear_fc2=Linear(v.intermediate_size, d, use_bias=True, dtype=dtype, rngs=rngs),
        )
        self.act = activation(v.hidden_act)

    def __call__(self, x: jax.Array, cos_sin, image_ids: jax.Array, block_starts: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x), cos_sin, image_ids, block_starts)
        return x + self.mlp["linear_fc2"](self.act(self.mlp["linear_fc1"](self.norm2(x))))


class VisionTower(nnx.Module):
    def __init__(self, v: Qwen3VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.patch_embed = Linear(v.patch_dim, v.hidden_size, use_bias=True, dtype=dtype, rngs=rngs)
        self.pos_embed = Table(v.num_position_embeddings, v.hidden_size, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([VisionBlock(v, dtype=dtype, rngs=rngs) for _ in range(v.depth)])
        self.merger = Merger(v, after_shuffle=False, dtype=dtype, rngs=rngs)
        self.deepstack_merger_list = nnx.List(
            [Merger(v, after_shuffle=True, dtype=dtype, rngs=rngs) for _ in v.deepstack_visual_indexes]
        )
        self.v = v

    def __call__(self, patches, pos, window_ids, image_ids, block_starts, pos_taps, pos_weights) -> jax.Array:
        """-> [P / 4, D_text x (1 + deepstack layers)]: each token's embedding, then its deepstack
        features."""
        v = self.v
        x = self.patch_embed(patches.astype(self.patch_embed.kernel.dtype))
        table = self.pos_embed.weight[...]
        positions = jnp.einsum(
            "pk,pkd->pd", pos_weights, jnp.take(table, pos_taps, axis=0).astype(jnp.float32)
        )
        x = x + positions.astype(x.dtype)
        cos_sin = vision_rope(v, pos)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos_sin, image_ids, block_starts)  # padding patches (-1) see each other only
            if i in v.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[v.deepstack_visual_indexes.index(i)](x))
        return jnp.concatenate([self.merger(x), *deepstack], axis=-1)


class Qwen3VLForConditionalGeneration(QwenVisionLanguageLM):
    config_class = Qwen3VLConfig
    layer_class = LlamaDecoderLayer

    def __init__(self, cfg: Qwen3VLConfig, backend, *, dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(cfg, backend, dtype=dtype, rngs=rngs)
        self.visual = VisionTower(cfg.vision, dtype=dtype, rngs=rngs)

    @classmethod
    def layers_reading_images(cls, cfg) -> range:
        return range(len(cfg.vision.deepstack_visual_indexes))

    def after_layer(self, mm: EncoderOutputs):
        """DeepStack: after layer i (i < the deepstack layers), the image tokens' hidden states gain
        their feature i (the cache row's slice after the embedding)."""
        d, num = self.cfg.hidden_size, len(self.cfg.vision.deepstack_visual_indexes)
        if not num:
            return None
        picked, is_image = mm.picked(), (mm.rows >= 0)[:, None]

        def add(x: jax.Array, layer: jax.Array) -> jax.Array:
            i = jnp.clip(layer, 0, num - 1)
            feature = jax.lax.dynamic_slice_in_dim(picked, d * (1 + i), d, axis=1).astype(x.dtype)
            return jnp.where(is_image & (layer < num), x + feature, x)

        return add
