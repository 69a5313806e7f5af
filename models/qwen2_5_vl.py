"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration): a windowed ViT over images of any size, a 2 x 2
patch merger, and the Qwen2 decoder with multimodal rotary positions (M-RoPE).

An image keeps its own resolution (the processor rounds it to a multiple of 28 pixels within its
min/max pixels): its patches form a (t, h, w) grid, and every 2 x 2 of them become one token, so an
image is h * w / 4 tokens. The vision tower (models/qwen_vl_tower.py) runs on a flat list of
patches, several images packed into one patch bucket, most of its layers attending within windows
of `window_size` pixels; the program is one per patch bucket.

M-RoPE: the decoder rotates three position streams (temporal, height, width) over three sections of
its rotary frequencies. A text token's three positions are equal; an image's tokens hold (start,
start + row, start + column), and the text after an image resumes at start + max(rows, columns). So
a request's positions past its prompt are its token index plus a constant delta (`mrope_positions`:
numpy, run by the worker for every step's tokens).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.models.llama import LlamaDecoderLayer
from xlaserve.models.multimodal import EncoderOutputs, VisionLanguageLM
from xlaserve.models.processor_settings import max_image_tokens, video_fps
from xlaserve.models.qwen import Qwen2Config
from xlaserve.models.qwen_vl_tower import QwenVisionConfig, VisionTower, vision_fields
from xlaserve.models.rope import base_inv_freq, rope_cos_sin


@dataclass(frozen=True)
class QwenImageFields:
    """What a Qwen VL config adds to its decoder's (Qwen2.5-VL's Qwen2, Qwen3-VL's Qwen3)."""

    vision: QwenVisionConfig | None = None
    image_token_id: int = -1
    mrope_section: tuple[int, ...] = (16, 24, 24)  # rotary frequencies per stream (t, h, w)
    bidirectional_images: bool = False
    # Tokens one image may have at most: the processor's max_pixels / (patch x merge)^2 (the model
    # directory's preprocessor_config.json, which models/loader.py reads beside config.json).
    max_image_tokens: int = 0
    video_fps: float = 2.0  # the frames per second a video's frames are taken as (the same file's `fps`)

    @property
    def video_interval(self) -> float:
        """The temporal positions between a video's frame pairs: tokens per second x seconds a pair."""
        return self.vision.tokens_per_second * self.vision.temporal_patch_size / self.video_fps

    @property
    def tokens_per_image(self) -> int:
        return self.max_image_tokens

    @property
    def mrope(self) -> bool:
        return True

    @property
    def mrope_streams(self) -> np.ndarray:
        """[rotary_dim / 2] which position stream (0 t, 1 h, 2 w) turns each rotary frequency:
        `mrope_section` frequencies each, in order."""
        return np.repeat(np.arange(len(self.mrope_section)), self.mrope_section)


@dataclass(frozen=True)
class Qwen2_5_VLConfig(QwenImageFields, Qwen2Config):
    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        vision = hf["vision_config"]
        return {
            **super().fields_from_hf(text_config(hf, text_ties=True)),
            **image_fields(hf, (16, 24, 24)),
            "vision": QwenVisionConfig(
                **vision_fields(vision),
                window_size=vision.get("window_size", 112),
                fullatt_block_indexes=tuple(vision.get("fullatt_block_indexes", ())),
            ),
        }


def text_config(hf: dict[str, Any], text_ties: bool = False) -> dict[str, Any]:
    """A Qwen VL config.json's decoder settings: its text_config over the top level's, but for the head:
    Hugging Face's composite model ties it by the top level's `tie_word_embeddings` (off when missing),
    whatever its text config says. text_ties: the text config's on ties it too (transformers 5 forwards
    it so for Qwen2.5-VL, whose pre-v5 saves wrote the flag there)."""
    inner = hf.get("text_config", {})
    text = {**hf, **inner, "architectures": hf.get("architectures")}
    text.pop("vision_config", None)
    text["tie_word_embeddings"] = bool(
        hf.get("tie_word_embeddings") or text_ties and inner.get("tie_word_embeddings")
    )
    return text


def image_fields(hf: dict[str, Any], default_section: tuple[int, ...]) -> dict[str, Any]:
    """The fields a Qwen VL config adds to its decoder's: image token, M-RoPE sections, image size."""
    text = text_config(hf)
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    return {
        "image_token_id": hf.get("image_token_id", -1),
        "mrope_section": tuple(rope.get("mrope_section", default_section)),
        "max_image_tokens": max_image_tokens(hf.get("preprocessor_config") or {}, hf["vision_config"]),
        "video_fps": video_fps(hf.get("preprocessor_config") or {}),
    }


# -- M-RoPE positions (the host's) ------------------------------------------------------------------


def image_positions(
    grid: tuple[int, int, int], spatial_merge_size: int, time_interval: float = 1.0
) -> np.ndarray:
    """[3, tokens] an image's (or a video's) M-RoPE offsets from its start: (frame x time_interval, row,
    column) of each token; the product in float32 and rounded down, as Hugging Face's (a fractional
    interval's products land on the same side of each integer)."""
    t, h, w = grid[0], grid[1] // spatial_merge_size, grid[2] // spatial_merge_size
    frames, rows, cols = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
    frames = np.floor(frames.astype(np.float32) * np.float32(time_interval)).astype(np.int64)
    return np.stack([frames.reshape(-1), rows.reshape(-1), cols.reshape(-1)])


def mrope_positions(
    features,
    start: int,
    stop: int,
    spatial_merge_size: int,
    num_prompt: int,
    video_interval: float = 1.0,
    tokens_per_second: float = 2.0,
) -> np.ndarray:
    """[3, stop - start] int32: the M-RoPE positions of a request's token positions [start, stop)
    (its prompt's `num_prompt` tokens hold `features`, in prompt order, each with its patch `grid`).

    In the prompt, the text after an image or video resumes past its longer side; past the prompt,
    every token is its index plus one delta: the prompt's largest position + 1 - its length (a video's
    frame pairs, `tokens_per_second` x its `seconds_per_grid` apart, else `video_interval`, may reach
    past the text after it)."""
    index = np.arange(start, stop)
    out = np.broadcast_to(index, (3, len(index))).copy()
    delta = 0  # where the text resumes after the images so far, less its index
    largest = -1  # the prompt's largest position
    for feature in features:  # a decode step's tokens overlap none: only their extents are read
        interval = 1.0
        if feature.modality == "video":
            seconds = feature.seconds_per_grid
            interval = (
                video_interval if seconds is None else np.float32(tokens_per_second) * np.float32(seconds)
            )
        t, h, w = (
            feature.grid[0],
            feature.grid[1] // spatial_merge_size,
            feature.grid[2] // spatial_merge_size,
        )
        begin = feature.offset + delta
        lo, hi = max(start, feature.offset), min(stop, feature.end)
        if lo < hi:
            image = image_positions(feature.grid, spatial_merge_size, interval)
            out[:, lo - start : hi - start] = begin + image[:, lo - feature.offset : hi - feature.offset]
        largest = max(largest, begin + max(int(np.float32(t - 1) * np.float32(interval)), h - 1, w - 1))
        delta += max(h, w) - feature.length  # text resumes past the longer side
        after = index >= feature.end
        out[:, after] = index[after] + delta
    if not features or features[-1].end < num_prompt:  # the prompt ends with text
        largest = max(largest, num_prompt - 1 + delta)
    past = index >= num_prompt
    out[:, past] = index[past] + largest + 1 - num_prompt
    return out.astype(np.int32)


class QwenVisionLanguageLM(VisionLanguageLM):
    """What Qwen2.5-VL and Qwen3-VL share: checkpoint names, and the decoder rotating by the step's
    M-RoPE positions. A family sets its config and layer classes and builds `self.visual`, whose
    call takes its vision config's `pack` outputs."""

    encoder_modules = ("visual",)

    @classmethod
    def prepare_hf_tensors(cls, cfg, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """transformers 5's names (`model.language_model.*`, `model.visual.*`) or the releases' (`model.*`,
        `visual.*`) as ours; the patch convolution as the matrix it is (its stride is its kernel)."""
        out = {}
        for name, tensor in tensors.items():
            if name.startswith("model.language_model."):
                name = "model." + name[len("model.language_model.") :]
            elif name.startswith("visual."):
                name = "model." + name
            name = name.replace(".merger.mlp.0.", ".merger.fc1.").replace(".merger.mlp.2.", ".merger.fc2.")
            name = name.replace("model.visual.patch_embed.proj.", "model.visual.patch_embed.")
            if name == "model.visual.patch_embed.weight":
                tensor = tensor.reshape(tensor.shape[0], -1)
            out[name] = tensor
        return out

    def encode_images(self, **packed) -> jax.Array:  # the vision config's `pack` outputs, less `dest`
        return self.visual(**packed)

    def image_metadata(self, md, mm: EncoderOutputs):
        if mm.mrope is not None:  # every layer rotates by the step's M-RoPE positions
            md = self.mrope_metadata(md, mm.mrope)
        return super().image_metadata(md, mm)

    def mrope_metadata(self, md, mrope: jax.Array):
        """`md` rotating every layer by the M-RoPE positions `mrope` [3, T] (an MTP layer's too)."""
        return dataclasses.replace(md, rope=rope_cos_sin(self._mrope_angles(mrope)))

    def _mrope_angles(self, mrope: jax.Array) -> jax.Array:  # [3, T] -> [T, head_dim / 2]
        cfg = self.cfg
        inv_freq = base_inv_freq(cfg.rotary_dim, cfg.rope_theta)
        picked = jnp.take(mrope, jnp.asarray(cfg.mrope_streams), axis=0).astype(jnp.float32)  # [hd / 2, T]
        return (picked * jnp.asarray(inv_freq, jnp.float32)[:, None]).T


class Qwen2_5_VLForConditionalGeneration(QwenVisionLanguageLM):
    config_class = Qwen2_5_VLConfig
    layer_class = LlamaDecoderLayer

    def __init__(self, cfg: Qwen2_5_VLConfig, backend, *, dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(cfg, backend, dtype=dtype, rngs=rngs)
        self.visual = VisionTower(cfg.vision, dtype=dtype, rngs=rngs)
