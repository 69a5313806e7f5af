"""A request's images as the core sees them: where their placeholder tokens sit, and a content hash.

The front end (engine/engine/mm_processor.py) turns each image into pixel values with the model's own
Hugging Face processor and expands its placeholder into `length` copies of the model's image token;
the prompt's ids then say nothing about which image it was. So the image's content hash travels with
it, and enters the prefix cache's block hashes (`mm_block_keys`): the same text with two different
images never shares K/V, the same image twice does. Plain data: no jax.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MultiModalFeature:
    """One image of a prompt: its placeholder tokens are prompt positions [offset, offset + length)."""

    modality: str  # "image" or "video" (a Qwen3-VL video: one feature a frame pair, its time's text between)
    mm_hash: str  # content hash of `data` (hex), the encoder cache's and the prefix cache's key
    offset: int
    length: int
    data: np.ndarray  # what the vision encoder runs on: pixel values [C, H, W] float32, or patches [P, K]
    # An image of its own size (Qwen2.5-VL): its (t, h, w) grid of patches, `data` one row per patch.
    grid: tuple[int, int, int] | None = None
    # A video (Qwen2.5-VL): the seconds each temporal grid of frames spans (Qwen's second_per_grid_ts,
    # temporal_patch_size / the kept frames' fps); its temporal M-RoPE positions step by it.
    seconds_per_grid: float | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, stop: int) -> bool:
        """Whether any of its placeholder positions lies in [start, stop)."""
        return self.offset < stop and start < self.end


def hash_pixels(pixels: np.ndarray, seconds_per_grid: float | None = None) -> str:
    """The content hash of one image's processed pixel values (shape and dtype included); a video's
    seconds per grid too, as its tokens' positions (so their K/V) depend on them."""
    array = np.ascontiguousarray(pixels)
    timing = "" if seconds_per_grid is None else f"@{float(seconds_per_grid)!r}"
    hasher = hashlib.sha256(f"{array.dtype.str}{array.shape}{timing}".encode())
    hasher.update(array.tobytes())
    return hasher.hexdigest()


def mm_block_keys(features, start: int, stop: int) -> tuple:
    """The prefix-cache extra keys of the block of token positions [start, stop): the content hash
    of every image whose placeholders it holds (vLLM's `_gen_mm_extra_hash_keys`). Empty for a block
    of text only, so text blocks hash as they always did."""
    return tuple(("mm", f.mm_hash) for f in features if f.overlaps(start, stop))
