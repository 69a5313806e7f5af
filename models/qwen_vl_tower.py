"""The Qwen VL vision towers' shared parts and Qwen2.5-VL's tower (models/qwen2_5_vl.py wires it to the
decoder; models/qwen3_vl.py's plainer tower reuses the config, the packing, the rotary embedding and the
attention).

A call's images are packed into one patch bucket (`pack_images`, on the host): each image from a query
block's start, its patches in window order, each carrying its (row, column) for the tower's 2-D rotary
embedding, its window and the image (a video's frame) it belongs to, and each merged token its encoder
cache row. The tower (`VisionTower`): a patch matrix, blocks whose attention (`attend_patches`) stays
within a window of `window_size` pixels (the `fullatt_block_indexes` blocks: within the whole image),
and a merger of each 2 x 2 patches into one token in the decoder's width. One program per patch bucket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.models.layers import Linear, RMSNorm, activation
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


# -- the host's side: patches in window order ----------------------------------------------------------


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
