"""Images into a vision-language model's step: the encoder's program and the device encoder cache.

The cache is one device array, `[(num_slots + 1) * N, D]`: slot s holds one image's N embeddings in
rows [s * N, (s + 1) * N) (the last slot is scratch, where padding images of a bucket are written).
Which image lives in which slot is the core's decision (core/encoder_cache_manager.py, by content
hash); this hook only makes the device agree: before the step's forward it encodes each image whose
slot does not yet hold it (`slot_contents`), in batches padded to an image-count bucket, then hands
the forward the cache and, per token, the row that replaces its embedding (models/multimodal.py).
So a step of text only adds nothing but a [T] int32 array, an image is encoded once however many
chunks and requests read it, and warm-up compiles one encoder program per bucket (the compile guard
holds). LLaVA's processor resizes every image to one size, so the count is the only bucketed shape.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.core.encoder_cache_manager import EncoderCacheLayout
from xlaserve.models.llava import tokens_per_image
from xlaserve.models.multimodal import EncoderOutputs
from xlaserve.worker.input_batch import isolate_failures
from xlaserve.worker.step_hooks import StepHook

# Images one encoder call takes at most (its buckets: 1, 2, 4); more in a step take several calls.
MAX_ITEMS_PER_CALL = 4


def _encode(graphdef, num_rows: int, params, cache, pixels, dest):
    """cache [S * N, D] with images `pixels` [B, C, H, W] encoded into slots `dest` [B]."""
    embeds = nnx.merge(graphdef, params).encode_images(pixels)  # [B, N, D]
    rows = dest[:, None] * num_rows + jnp.arange(num_rows, dtype=jnp.int32)[None]  # [B, N]
    return cache.at[rows.reshape(-1)].set(embeds.reshape(-1, embeds.shape[-1]).astype(cache.dtype))


class MultiModalHook(StepHook):
    """The step's image rows and encodes (module doc). `runner`: the ModelRunner (its weights are read
    at each call, so new weights take effect without recompiling)."""

    name = "mm"

    def __init__(self, runner, tokens_per_item: int):
        cfg, sched = runner.model_config, runner.config.scheduler
        self.runner = runner
        self.tokens_per_item = tokens_per_item
        vision = cfg.vision
        self.pixel_shape = (vision.num_channels, vision.image_size, vision.image_size)
        max_items = max(1, min(MAX_ITEMS_PER_CALL, sched.max_num_batched_tokens // tokens_per_item))
        self.buckets = [b for b in (1, 2, 4) if b <= max_items]
        # vLLM's default encoder cache: a step's worth of tokens (here at least two steps' images).
        num_slots = max(2 * self.buckets[-1], sched.max_num_batched_tokens // tokens_per_item)
        # Gemma 3's image tokens see their whole image: each step also carries, per token, how far.
        self.bidirectional = cfg.bidirectional_images
        if self.bidirectional and tokens_per_item > sched.max_num_batched_tokens:
            raise ValueError(
                f"max_num_batched_tokens ({sched.max_num_batched_tokens}) must hold one image's "
                f"{tokens_per_item} tokens: they attend to each other, so they are computed in one step"
            )
        self.layout = EncoderCacheLayout(num_slots, tokens_per_item, self.buckets[-1], self.bidirectional)
        self.scratch_slot = num_slots
        shape = ((num_slots + 1) * tokens_per_item, cfg.hidden_size)
        placement = runner.placement
        self.cache = placement.zeros(shape, runner.dtype, placement.replicated)
        self._encode_fn = jax.jit(
            partial(_encode, runner.graphdef, tokens_per_item),
            donate_argnames=("cache",),
            out_shardings=self.cache.sharding,
            compiler_options=runner.config.compilation.compiler_options(),
        )
        self.slot_contents: dict[int, str] = {}  # slot -> the mm_hash encoded there
        self.num_encoded = 0  # images encoded on the device (tests, metrics)

    def prepare(self, scheduled, num_tokens, num_seqs, failed) -> dict[str, np.ndarray]:
        rows = np.full(num_tokens, -1, np.int32)
        ahead = np.zeros(num_tokens, np.int32) if self.bidirectional else None
        to_encode: dict[int, object] = {}  # slot -> feature
        offset = 0
        for s in scheduled:
            if s.request.mm_features:
                isolate_failures(
                    failed, s, "placing its images", self._fill_rows, rows, ahead, offset, s, to_encode
                )
            offset += s.num_new_tokens
        arrays = {"rows": rows} if ahead is None else {"rows": rows, "ahead": ahead}
        items = list(to_encode.items())
        for call, start in enumerate(range(0, len(items), self.buckets[-1])):
            chunk = items[start : start + self.buckets[-1]]
            bucket = next(b for b in self.buckets if b >= len(chunk))
            pixels = np.zeros((bucket, *self.pixel_shape), np.float32)
            dest = np.full(bucket, self.scratch_slot, np.int32)
            for i, (slot, feature) in enumerate(chunk):
                pixels[i], dest[i] = feature.data, slot
                self.slot_contents[slot] = feature.mm_hash
            arrays[f"pixels_{call}"], arrays[f"dest_{call}"] = pixels, dest
        self.num_encoded += len(items)
        return arrays

    def _fill_rows(self, rows: np.ndarray, ahead: np.ndarray | None, offset: int, s, to_encode: dict) -> None:
        request, n = s.request, self.tokens_per_item
        start, stop = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
        for index, feature in enumerate(request.mm_features):
            if not feature.overlaps(start, stop):
                continue
            if feature.length != n or tuple(feature.data.shape) != self.pixel_shape:
                raise ValueError(
                    f"image {index} has {feature.length} placeholders of pixels {feature.data.shape}; "
                    f"the model takes {n} of {self.pixel_shape}"
                )
            slot = request.encoder_slots[index]  # set by the scheduler when the chunk reached it
            lo, hi = max(start, feature.offset), min(stop, feature.end)
            if ahead is not None:  # each of the image's tokens sees up to its last one
                if hi < feature.end:
                    raise ValueError(
                        f"image {index}'s tokens are cut by the step ({lo}..{hi} of {feature.end})"
                    )
                ahead[offset + lo - start : offset + hi - start] = feature.end - 1 - np.arange(lo, hi)
            rows[offset + lo - start : offset + hi - start] = slot * n + np.arange(
                lo - feature.offset, hi - feature.offset, dtype=np.int32
            )
            if self.slot_contents.get(slot) != feature.mm_hash and slot not in to_encode:
                to_encode[slot] = feature

    def forward_inputs(self, arrays) -> dict:
        params = self.runner.params
        call = 0
        while f"pixels_{call}" in arrays:
            self.cache = self._encode_fn(params, self.cache, arrays[f"pixels_{call}"], arrays[f"dest_{call}"])
            call += 1
        return {"mm": EncoderOutputs(self.cache, arrays["rows"], arrays.get("ahead"))}

    def warm_up(self, batches, num_seqs_for) -> list:
        """Each bucket's encoder program, run once into the scratch slot (the compile guard is armed
        after this)."""
        ready = self.runner.placement.step_inputs
        for bucket in self.buckets:
            pixels = np.zeros((bucket, *self.pixel_shape), np.float32)
            dest = np.full(bucket, self.scratch_slot, np.int32)
            self.cache = self._encode_fn(self.runner.params, self.cache, *ready((pixels, dest)))
        return []


def make_mm_hook(runner) -> MultiModalHook | None:
    """The hook of a vision-language model; None for a text-only one."""
    n = tokens_per_image(runner.model_config)
    if n and runner.config.parallel.pipeline_parallel_size > 1:
        raise ValueError(
            "pipeline_parallel_size must be 1 for a vision-language model (its images are merged on the "
            f"first stage, which is not built yet), got {runner.config.parallel.pipeline_parallel_size}"
        )
    return MultiModalHook(runner, n) if n else None
