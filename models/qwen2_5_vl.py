"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration): a windowed ViT over images of any size, a 2 x 2
patch merger, and the Qwen2 decoder with multimodal rotary positions (M-RoPE).

An image keeps its own resolution (the processor rounds it to a multiple of 28 pixels within its
min/max pixels): its patches form a (t, h, w) grid, and every 2 x 2 of them become one token, so an
image is h * w / 4 tokens. The vision tower runs on a flat list of patches: several images packed
into one patch bucket, each patch carrying its (row, column) for the tower's 2-D rotary embedding,
the window and the image it belongs to (most layers attend within windows of `window_size` pixels,
the `fullatt_block_indexes` layers within the whole image). The host lays the patches out in window
order and says where each merged token goes (`pack_images`); the program is one per patch bucket.

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

from xlaserve.models.layers import Linear, RMSNorm, activation
from xlaserve.models.llama import LlamaDecoderLayer
from xlaserve.models.multimodal import EncoderOutputs, VisionLanguageLM
from xlaserve.models.processor_settings import max_image_tokens, video_fps
from xlaserve.models.qwen import Qwen2Config
from xlaserve.models.rope import base_inv_freq, rope_cos_sin, rotate_halves


@dataclass(frozen=True)
class QwenVisionConfig:
    """config.json's `vision_config` of Qwen2.5-VL."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    depth: int
    out_hidden_size: int  # the decoder's width
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112  # pixels per window side
    fullatt_block_indexes: tuple[int, ...] = ()
    in_channels: int = 3
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    tokens_per_second: float = 2.0  # a video's temporal positions per second

    @property
    def patch_dim(self) -> int:  # one patch's pixel values: C x T x p x p
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:  # patches per token
        return self.spatial_merge_size**2

    @property
    def window_units(self) -> int:  # tokens per window side
        return self.window_size // self.spatial_merge_size // self.patch_size

    def pack(self, images: list, bucket: int) -> dict[str, np.ndarray]:
        """The tower's inputs for `images` packed into `bucket` patches (`pack_images`)."""
        return pack_images(self, images, bucket)


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
            **super().fields_from_hf(text_config(hf)),
            **image_fields(hf, (16, 24, 24)),
            "vision": QwenVisionConfig(
                **vision_fields(vision),
                window_size=vision.get("window_size", 112),
                fullatt_block_indexes=tuple(vision.get("fullatt_block_indexes", ())),
            ),
        }


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A Qwen VL config.json's decoder settings: its text_config over the top level's."""
    text = {**hf, **hf.get("text_config", {}), "architectures": hf.get("architectures")}
    text.pop("vision_config", None)
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


def vision_fields(vision: dict[str, Any]) -> dict[str, Any]:
    """The vision_config fields Qwen2.5-VL's and Qwen3-VL's towers share."""
    return dict(
        hidden_size=vision["hidden_size"],
        intermediate_size=vision["intermediate_size"],
        num_heads=vision["num_heads"],
        depth=vision["depth"],
        out_hidden_size=vision["out_hidden_size"],
        patch_size=vision.get("patch_size", 14),
        temporal_patch_size=vision.get("temporal_patch_size", 2),
        spatial_merge_size=vision.get("spatial_merge_size", 2),
        in_channels=vision.get("in_channels", vision.get("in_chans", 3)),
        hidden_act=vision.get("hidden_act", "silu"),
        rope_theta=float((vision.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        tokens_per_second=float(vision.get("tokens_per_second", 2.0)),
    )


# The towers' attention, as varlen flash attention (Hugging Face's cu_seqlens), keeps each image's
# computation its own: it takes QUERY_BLOCK query patches at a time, every image starts a block
# (`aligned`), and a block attends to a window of the bucket's length from its image's first patch, so an
# image's keys sit at the same places of the reduction whatever the call packs around it or the bucket
# it lands in (the rest of the window is masked: exact zeros). A block's scores are [heads, block, P]:
# memory grows with the bucket's patches P, not P^2 (the largest image of Qwen3-VL's default settings,
# 65,536 patches, needs 512 MiB a block instead of 256 GiB at once).
QUERY_BLOCK = 128


# -- the host's side: patches in window order, and M-RoPE positions ----------------------------------


def _window_order(grid_h: int, grid_w: int, units: int) -> tuple[np.ndarray, np.ndarray]:
    """An image's tokens (row-major over its grid_h x grid_w tokens) in window order, and each one's
    window number: windows of units x units tokens, row-major, the last row and column of windows cut
    short where the grid ends."""
    index = np.arange(grid_h * grid_w).reshape(grid_h, grid_w)
    rows, cols = np.divmod(index, grid_w)
    window = (rows // units) * -(-grid_w // units) + cols // units
    window = window.reshape(-1)
    order = np.lexsort((cols.reshape(-1), rows.reshape(-1), window))  # by window, then row-major
    return order, window[order]


def aligned(num_patches: int) -> int:
    """Where the next image of a packed call starts after `num_patches`: at a query block's start, so
    its attention is the same computation wherever it lands (`attend_patches`)."""
    return -(-num_patches // QUERY_BLOCK) * QUERY_BLOCK


def pack_images(
    vision: QwenVisionConfig, images: list[tuple[tuple[int, int, int], np.ndarray, np.ndarray]], bucket: int
) -> dict[str, np.ndarray]:
    """The encoder program's inputs for `images` [(grid (t, h, w) in patches, patches [P, patch_dim] in
    the processor's order, the cache row of each of its tokens [P / 4])], packed into `bucket` patches,
    each image from a query block's start (`aligned`): the patches in window order, their (row, column),
    window and image numbers (-1: padding), the first patch of the image each query block belongs to,
    and the cache row of each merged token (`scratch` rows for the padding: the caller's `dest`
    default)."""
    m, unit = vision.spatial_merge_size, vision.merge_unit
    patches = np.zeros((bucket, vision.patch_dim), np.float32)
    pos = np.zeros((bucket, 2), np.int32)
    window_ids = np.full(bucket, -1, np.int32)
    image_ids = np.full(bucket, -1, np.int32)
    dest = np.full(bucket // unit, -1, np.int32)
    block_starts = np.zeros(-(-bucket // QUERY_BLOCK), np.int32)
    end, num_windows, num_frames = 0, 0, 0
    for (t, h, w), pixels, rows in images:
        start = aligned(end)
        gh, gw = h // m, w // m
        order, window = _window_order(gh, gw, vision.window_units)
        order = (np.arange(t)[:, None] * gh * gw + order[None]).reshape(-1)  # frames one after another
        window = (np.arange(t)[:, None] * (window.max() + 1) + window[None]).reshape(-1)
        n = len(order) * unit
        # The processor writes each token's 2 x 2 patches together, tokens row-major: move tokens whole.
        patch_index = (order[:, None] * unit + np.arange(unit)[None]).reshape(-1)
        patches[start : start + n] = pixels[patch_index]
        token_rows, token_cols = np.divmod(order % (gh * gw), gw)
        sub_rows, sub_cols = np.divmod(np.arange(unit), m)
        pos[start : start + n, 0] = (token_rows[:, None] * m + sub_rows[None]).reshape(-1)
        pos[start : start + n, 1] = (token_cols[:, None] * m + sub_cols[None]).reshape(-1)
        window_ids[start : start + n] = np.repeat(window + num_windows, unit)
        # The full-attention blocks attend within a frame (an image is one): Hugging Face's cu_seqlens.
        image_ids[start : start + n] = num_frames + np.repeat(np.arange(t), n // t)
        dest[start // unit : (start + n) // unit] = rows[order]
        block_starts[start // QUERY_BLOCK : -(-(start + n) // QUERY_BLOCK)] = start
        end, num_windows, num_frames = start + n, num_windows + int(window.max()) + 1, num_frames + t
    return {
        "patches": patches,
        "pos": pos,
        "window_ids": window_ids,
        "image_ids": image_ids,
        "block_starts": block_starts,
        "dest": dest,
    }


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


# -- the vision tower ---------------------------------------------------------------------------------


def vision_rope(v: QwenVisionConfig, pos: jax.Array):
    """cos and sin of the tower's 2-D rotary embedding for patches at `pos` [P, 2] (row, column): the
    first half of each head's frequencies turned by the row, the second by the column."""
    head_dim = v.hidden_size // v.num_heads
    inv_freq = jnp.asarray(base_inv_freq(head_dim // 2, v.rope_theta), jnp.float32)  # [head_dim / 4]
    return rope_cos_sin((pos.astype(jnp.float32)[:, :, None] * inv_freq).reshape(pos.shape[0], -1))


def attend_patches(
    qkv: jax.Array, num_heads: int, cos_sin, ids: jax.Array, block_starts: jax.Array
) -> jax.Array:
    """The tower's attention: qkv [P, 3D] (q, k, v one after another), q and k rotated in float32,
    each patch attending to the patches of its own id (`ids` [P]: its window or its image; padding,
    -1, sees padding) -> [P, D], QUERY_BLOCK query patches at a time, each over the P patches from
    its image's first (`block_starts`, one per block: `pack_images`)."""
    p, d = qkv.shape[0], qkv.shape[1] // 3
    q, k, v = (qkv.reshape(p, 3, num_heads, d // num_heads)[:, i] for i in range(3))
    q = rotate_halves(q.astype(jnp.float32), cos_sin).astype(qkv.dtype)
    k = rotate_halves(k.astype(jnp.float32), cos_sin).astype(qkv.dtype)
    # Queries padded to whole blocks (id -1, rows dropped).
    pad = -p % QUERY_BLOCK
    q_blocks = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(-1, QUERY_BLOCK, *q.shape[1:])
    id_blocks = jnp.pad(ids, (0, pad), constant_values=-1).reshape(-1, QUERY_BLOCK)

    def attend(q_block, q_ids, keys, values, key_ids):  # -> [B, heads, head_dim]
        scores = jnp.einsum("qhd,khd->hqk", q_block, keys, preferred_element_type=jnp.float32)
        seen = (q_ids[:, None] == key_ids[None, :])[None]
        probs = jax.nn.softmax(jnp.where(seen, scores * (d // num_heads) ** -0.5, -jnp.inf), axis=-1)
        return jnp.einsum("hqk,khd->qhd", probs.astype(values.dtype), values)

    if len(q_blocks) == 1:  # a bucket of one block holds one image, from patch 0: its window is all keys
        return attend(q_blocks[0], id_blocks[0], k, v, ids)[:p].reshape(p, d)
    # Each block's window of P keys from its image's first; keys past P (id -2) are seen by none.
    k, v = (jnp.pad(x, ((0, p), (0, 0), (0, 0))) for x in (k, v))
    key_ids = jnp.pad(ids, (0, p), constant_values=-2)

    def attend_block(block):
        q_block, q_ids, start = block
        window = (jax.lax.dynamic_slice_in_dim(x, start, p) for x in (k, v, key_ids))
        return attend(q_block, q_ids, *window)

    return jax.lax.map(attend_block, (q_blocks, id_blocks, block_starts)).reshape(-1, d)[:p]


class PatchAttention(nnx.Module):
    """The towers' attention: one fused qkv matrix, `attend_patches`, an output matrix."""

    def __init__(self, d: int, num_heads: int, *, dtype, rngs: nnx.Rngs):
        self.qkv = Linear(d, 3 * d, use_bias=True, dtype=dtype, rngs=rngs)
        self.proj = Linear(d, d, use_bias=True, dtype=dtype, rngs=rngs)
        self.num_heads = num_heads

    def __call__(self, x: jax.Array, cos_sin, ids: jax.Array, block_starts: jax.Array) -> jax.Array:
        return self.proj(attend_patches(self.qkv(x), self.num_heads, cos_sin, ids, block_starts))


class VisionBlock(nnx.Module):
    def __init__(self, v: QwenVisionConfig, *, dtype, rngs: nnx.Rngs):
        d = v.hidden_size
        self.norm1 = RMSNorm(d, 1e-6, dtype=dtype)
        self.norm2 = RMSNorm(d, 1e-6, dtype=dtype)
        self.attn = PatchAttention(d, v.num_heads, dtype=dtype, rngs=rngs)
        self.mlp = nnx.Dict(
            gate_proj=Linear(d, v.intermediate_size, use_bias=True, dtype=dtype, rngs=rngs),
            up_proj=Linear(d, v.intermediate_size, use_bias=True, dtype=dtype, rngs=rngs),
            down_proj=Linear(v.intermediate_size, d, use_bias=True, dtype=dtype, rngs=rngs),
        )
        self.act = activation(v.hidden_act)

    def __call__(self, x: jax.Array, cos_sin, ids: jax.Array, block_starts: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x), cos_sin, ids, block_starts)  # x [P, D], ids [P]
        h = self.norm2(x)
        mlp = self.mlp
        return x + mlp["down_proj"](self.act(mlp["gate_proj"](h)) * mlp["up_proj"](h))


class VisionTower(nnx.Module):
    """Patches -> merged tokens in the decoder's width (module doc)."""

    def __init__(self, v: QwenVisionConfig, *, dtype, rngs: nnx.Rngs):
        self.patch_embed = Linear(v.patch_dim, v.hidden_size, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([VisionBlock(v, dtype=dtype, rngs=rngs) for _ in range(v.depth)])
        merged = v.hidden_size * v.merge_unit
        self.merger = nnx.Dict(
            ln_q=RMSNorm(v.hidden_size, 1e-6, dtype=dtype),
            fc1=Linear(merged, merged, use_bias=True, dtype=dtype, rngs=rngs),
            fc2=Linear(merged, v.out_hidden_size, use_bias=True, dtype=dtype, rngs=rngs),
        )
        self.v = v

    def __call__(self, patches, pos, window_ids, image_ids, block_starts) -> jax.Array:  # -> [P / 4, D_text]
        v = self.v
        x = self.patch_embed(patches.astype(self.patch_embed.kernel.dtype))
        cos_sin = vision_rope(v, pos)
        # Padding patches (ids -1) see each other only: their rows are never read.
        for i, block in enumerate(self.blocks):
            x = block(x, cos_sin, image_ids if i in v.fullatt_block_indexes else window_ids, block_starts)
        merger = self.merger
        x = merger["ln_q"](x).reshape(-1, v.hidden_size * v.merge_unit)
        return merger["fc2"](jax.nn.gelu(merger["fc1"](x), approximate=False))


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
