"""Images into a vision-language model's step: the encoder's program and the device encoder cache.

The cache is one device array, `[(num_slots + 1) * N, D]`: slot s holds one image's N embeddings in
rows [s * N, (s + 1) * N) (the last slot is scratch, where padding images of a bucket are written).
Which image lives in which slot is the core's decision (core/encoder_cache_manager.py, by content
hash); this hook only makes the device agree: before the step's forward it encodes each image whose
slot does not yet hold it (`slot_contents`), in batches padded to an image-count bucket, then hands
the forward the cache and, per token, the row that replaces its embedding (models/multimodal.py).
So a step of text only adds nothing but a [T] int32 array, an image is encoded once however many
chunks and requests read it, and warm-up compiles one encoder program per bucket (the compile guard
holds). LLaVA's and Gemma 3's processors resize every image to one size, so the count is the only
bucketed shape (`MultiModalHook`). Qwen2.5-VL keeps each image's size: an image is h x w patches and
h x w / 4 tokens, at most N (its processor's max_pixels); its images' patches are packed into one
patch-count bucket per call (`PackedPatchesHook`), and every step also carries each token's M-RoPE
positions [3, T] (models/qwen2_5_vl.py `mrope_positions`).

On pipeline stages (worker/pipeline_runner.py) the encoder and its cache live on the first stage's
devices, where the embedding is and the rows are merged; every stage gets the step's per-token arrays
(M-RoPE positions, Gemma 3's `attend_ahead`) for its layers, and a later stage whose layers read the image
rows after the merge (Qwen3-VL's DeepStack: `layers_reading_images`) the step's rows themselves, [T, D]
gathered on the first stage and copied to its devices as the hidden states are. With the stages across
processes the encoder and its cache are the first stage's process's (process 0's, which prepares every
step); another process's later stage gets the per-token arrays with the step, and its rows from process
0 by JAX's cross-host transfer, sent (`send_rows`) right after the hidden states that stage takes.
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
from xlaserve.models.qwen2_5_vl import mrope_positions
from xlaserve.models.qwen_vl_tower import QUERY_BLOCK, QwenVisionConfig, aligned
from xlaserve.models.registry import get_model_class
from xlaserve.worker.input_batch import isolate_failures
from xlaserve.worker.step_hooks import StepHook

# Images one encoder call takes at most (its buckets: 1, 2, 4); more in a step take several calls.
MAX_ITEMS_PER_CALL = 4
# The largest tower attention a packed-patch bucket may need: one query block's [heads, block, P] float32
# scores (models/qwen_vl_tower.attend_patches).
MAX_TOWER_SCORES_BYTES = 8 * 2**30


def _pick(cache, rows):
    """[T, D] each token's cache row (row 0 where rows < 0): the step's image rows for a later stage."""
    return jnp.take(cache, jnp.maximum(rows, 0), axis=0)


def _encode(graphdef, params, cache, dest, **inputs):
    """cache [S * N, D] with the encoder's output rows written at rows `dest` ([B * N], or one per
    merged token of packed patches): `inputs` are `encode_images`' (LLaVA's pixels [B, C, H, W])."""
    embeds = nnx.merge(graphdef, params).encode_images(**inputs)
    return cache.at[dest].set(embeds.reshape(-1, embeds.shape[-1]).astype(cache.dtype))


class MultiModalHook(StepHook):
    """The step's image rows and encodes (module doc). `runner`: the ModelRunner (its weights are read
    at each call, so new weights take effect without recompiling)."""

    name = "mm"
    runs_on_stages = True  # the encoder on the first stage, each stage its layers' inputs (module doc)

    def __init__(self, runner, tokens_per_item: int):
        cfg, sched = runner.model_config, runner.config.scheduler
        self.runner = runner
        self.tokens_per_item = tokens_per_item
        self.buckets = self._set_up_encoder(cfg, sched)
        self.max_items_per_step = self._max_items_per_step()
        # vLLM's default encoder cache: a step's worth of tokens (here at least two steps' images).
        num_slots = max(2 * self.max_items_per_step, sched.max_num_batched_tokens // tokens_per_item)
        # Gemma 3's image tokens see their whole image: each step also carries, per token, how far.
        self.bidirectional = cfg.bidirectional_images
        if self.bidirectional and tokens_per_item > sched.max_num_batched_tokens:
            raise ValueError(
                f"max_num_batched_tokens ({sched.max_num_batched_tokens}) must hold one image's "
                f"{tokens_per_item} tokens: they attend to each other, so they are computed in one step"
            )
        self.layout = EncoderCacheLayout(
            num_slots, tokens_per_item, self.max_items_per_step, self.bidirectional
        )
        self.scratch_slot = num_slots
        shape = ((num_slots + 1) * tokens_per_item, cfg.encoder_output_width)
        stages = runner.stage_placements  # [(layers, placement)]: the first stage's holds the embedding
        self.placement = stages[0][1]
        # A step's image rows [T, D] as another process's stage receives them.
        self.rows_dtype, self.rows_width = runner.dtype, cfg.encoder_output_width
        self.is_warming_up = False  # (a pipeline's warm-up: rows from another process are shape structs)
        self.mrope = cfg.mrope
        # An MTP drafter rotates by the step's M-RoPE positions too (worker/mtp.py): `forward_inputs`
        # places them on the devices itself, once, and the drafter's program reads that array.
        spec = runner.config.speculative
        self.shares_mrope = self.mrope and spec is not None and spec.method == "mtp"
        self.placed_mrope = None  # the step's [3, T] positions as placed, where `shares_mrope`
        options = runner.config.compilation.compiler_options()
        # None: the first stage is another process's (under tensor parallelism every process holds a part)
        self.cache = self._encode_fn = None
        if any(d.process_index == jax.process_index() for d in self.placement.mesh.devices.flat):
            self.cache = self.placement.zeros(shape, runner.dtype, self.placement.replicated)
            self._encode_fn = jax.jit(
                partial(_encode, runner.encoder_model[0]),
                donate_argnames=("cache",),
                out_shardings=self.placement.replicated,
                compiler_options=options,
            )
        # Where a later stage's layers read the image rows: its devices, to copy the step's rows to.
        reading = set(get_model_class(cfg.architecture).layers_reading_images(cfg))
        self.row_targets = [
            placement.replicated if index and reading & set(layers) else None
            for index, (layers, placement) in enumerate(stages)
        ]
        self._pick_fn = jax.jit(_pick, out_shardings=self.placement.replicated, compiler_options=options)
        self.slot_contents: dict[int, str] = {}  # slot -> the mm_hash encoded there
        self.num_encoded = 0  # images encoded on the device (tests, metrics)
        self.num_encode_calls = 0  # encoder programs run (several images may share one)

    # -- what differs between encoders: images of one size (LLaVA, Gemma 3), or packed patches ----------

    def _set_up_encoder(self, cfg, sched) -> list[int]:
        """The shapes the encoder takes, and its program's buckets (here images per call)."""
        max_items = max(1, min(MAX_ITEMS_PER_CALL, sched.max_num_batched_tokens // self.tokens_per_item))
        vision = cfg.vision
        self.pixel_shape = (vision.num_channels, vision.image_size, vision.image_size)
        return [b for b in (1, 2, 4) if b <= max_items]

    def _max_items_per_step(self) -> int:
        return self.buckets[-1]

    def _check(self, index: int, feature) -> None:
        if feature.length != self.tokens_per_item or tuple(feature.data.shape) != self.pixel_shape:
            raise ValueError(
                f"image {index} has {feature.length} placeholders of pixels {feature.data.shape}; "
                f"the model takes {self.tokens_per_item} of {self.pixel_shape}"
            )

    def _calls(self, items: list) -> list[dict[str, np.ndarray]]:
        """The encoder calls' inputs for `items` [(slot, feature)]: images in count buckets."""
        calls, n = [], self.tokens_per_item
        for start in range(0, len(items), self.buckets[-1]):
            chunk = items[start : start + self.buckets[-1]]
            bucket = next(b for b in self.buckets if b >= len(chunk))
            pixels = np.zeros((bucket, *self.pixel_shape), np.float32)
            slots = np.full(bucket, self.scratch_slot, np.int32)
            for i, (slot, feature) in enumerate(chunk):
                pixels[i], slots[i] = feature.data, slot
            calls.append({"pixels": pixels, "dest": self._slot_rows(slots, n)})
        return calls

    def _warm_up_inputs(self, bucket: int) -> dict[str, np.ndarray]:
        slots = np.full(bucket, self.scratch_slot, np.int32)
        pixels = np.zeros((bucket, *self.pixel_shape), np.float32)
        return {"pixels": pixels, "dest": self._slot_rows(slots, self.tokens_per_item)}

    @staticmethod
    def _slot_rows(slots: np.ndarray, n: int) -> np.ndarray:
        """The cache rows of n rows in each of `slots`, slot after slot."""
        return (slots[:, None] * n + np.arange(n, dtype=np.int32)[None]).reshape(-1).astype(np.int32)

    # -----------------------------------------------------------------------------------------------------

    def step_mrope(self, scheduled, num_tokens: int, failed: set[str]) -> np.ndarray | None:
        """[3, T] the step's M-RoPE positions, every token's, text included (models/qwen2_5_vl.py);
        None for a model without them."""
        if not self.mrope:
            return None
        mrope = np.zeros((3, num_tokens), np.int32)
        offset = 0
        for s in scheduled:
            isolate_failures(failed, s, "placing its M-RoPE positions", self._fill_mrope, mrope, offset, s)
            offset += s.num_new_tokens
        return mrope

    def step_mrope_placed(self, num_tokens: int):
        """The [3, T] positions `forward_inputs` placed for this step's forward, which an MTP drafter's
        program reads after it; before any step (warm-up lowers the drafter's programs first), the shape
        of a step's of `num_tokens`."""
        placed = self.placed_mrope
        if placed is None or placed.shape[1] != num_tokens:
            return jax.ShapeDtypeStruct((3, num_tokens), np.int32, sharding=self.placement.replicated)
        return placed

    def prepare(self, scheduled, num_tokens, num_seqs, failed) -> dict[str, np.ndarray]:
        rows = np.full(num_tokens, -1, np.int32)
        ahead = np.zeros(num_tokens, np.int32) if self.bidirectional else None
        mrope = self.step_mrope(scheduled, num_tokens, failed)
        to_encode: dict[int, object] = {}  # slot -> feature
        offset = 0
        for s in scheduled:
            if s.request.mm_features:
                isolate_failures(
                    failed, s, "placing its images", self._fill_rows, rows, ahead, offset, s, to_encode
                )
            offset += s.num_new_tokens
        arrays = {"rows": rows}
        if ahead is not None:
            arrays["ahead"] = ahead
        if mrope is not None:
            arrays["mrope"] = mrope
        items = list(to_encode.items())
        for slot, feature in items:
            self.slot_contents[slot] = feature.mm_hash
        for call, inputs in enumerate(self._calls(items)):
            arrays |= {f"encode{call}.{name}": array for name, array in inputs.items()}
        self.num_encoded += len(items)
        return arrays

    def _fill_mrope(self, mrope: np.ndarray, offset: int, s) -> None:
        start = s.num_computed_tokens
        mrope[:, offset : offset + s.num_new_tokens] = mrope_positions(
            s.request.mm_features,
            start,
            start + s.num_new_tokens,
            self.spatial_merge_size,
            s.request.num_prompt_tokens,
            self.video_interval,
            self.vision.tokens_per_second,
        )

    def _fill_rows(self, rows: np.ndarray, ahead: np.ndarray | None, offset: int, s, to_encode: dict) -> None:
        request, n = s.request, self.tokens_per_item
        start, stop = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
        for index, feature in enumerate(request.mm_features):
            if not feature.overlaps(start, stop):
                continue
            self._check(index, feature)
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

    def forward_inputs(self, arrays, stage=0) -> dict:
        """The first stage (or the whole model): the step's images encoded into the cache, which it reads
        by `rows`. A later stage: the step's rows [T, D] where its layers read them, else no cache."""
        rows, ahead, mrope = arrays["rows"], arrays.get("ahead"), arrays.get("mrope")
        if stage:
            picked = self._stage_rows(rows, stage)
            if picked is not None:  # token t's row is row t of its own
                rows = np.where(rows >= 0, np.arange(len(rows), dtype=np.int32), np.int32(-1))
            return {"mm": EncoderOutputs(picked, rows, ahead, mrope)}
        if mrope is not None and self.shares_mrope:  # one copy to the devices for the forward and the drafter
            mrope = self.placed_mrope = self.placement.put_replicated(mrope)
        params = self.runner.encoder_model[1]
        call = 0
        while f"encode{call}.dest" in arrays:
            prefix = f"encode{call}."
            inputs = {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}
            self.cache = self._encode_fn(params, self.cache, **inputs)
            call += 1
        self.num_encode_calls += call
        return {"mm": EncoderOutputs(self.cache, rows, ahead, mrope)}

    def _stage_rows(self, rows, stage: int) -> jax.Array | None:
        """The step's image rows [T, D] (token t's at row t) on stage `stage`'s devices, or None where its
        layers read none. The first stage's `forward_inputs` of the step ran before: the cache holds the
        step's images."""
        target = self.row_targets[stage]
        if target is None:
            return None
        if self.cache is not None:
            return jax.device_put(self._pick_fn(self.cache, rows), target)
        # From the first stage's process (its `send_rows`): a stand-in on its devices, no local data.
        shape = (rows.shape[0], self.rows_width)
        if self.is_warming_up:
            return jax.ShapeDtypeStruct(shape, self.rows_dtype, sharding=target)
        source = jax.make_array_from_single_device_arrays(
            shape, self.placement.replicated, [], dtype=self.rows_dtype
        )
        return jax.device_put(source, target)

    def send_rows(self, arrays, stage: int) -> None:
        """The step's image rows to stage `stage` of another process, where its layers read them (the
        first stage's process; after the step's first stage ran, in the order that stage receives)."""
        if self.cache is not None:
            self._stage_rows(self.placement.step_inputs(arrays["rows"]), stage)

    def warm_up(self, batches, num_seqs_for) -> list:
        """Each bucket's encoder program, run once into the scratch slot, and the later stages' row
        gather per token bucket (the compile guard is armed after this)."""
        if self.cache is None:  # the encoder is another process's
            return []
        ready = self.placement.step_inputs
        params = self.runner.encoder_model[1]
        for bucket in self.buckets:
            self.cache = self._encode_fn(params, self.cache, **ready(self._warm_up_inputs(bucket)))
        if any(self.row_targets):
            for num_tokens in batches:
                self._pick_fn(self.cache, ready(np.full(num_tokens, -1, np.int32)))
        return []


def patch_buckets(vision: QwenVisionConfig, max_patches: int) -> list[int]:
    """The packed-patch buckets for images of up to `max_patches` patches: powers of two from 16
    tokens' patches up to that largest image."""
    scores = vision.num_heads * QUERY_BLOCK * max_patches * 4  # a smaller bucket pads its queries to a block
    if scores > MAX_TOWER_SCORES_BYTES:
        largest = MAX_TOWER_SCORES_BYTES // (4 * vision.num_heads * QUERY_BLOCK) // vision.merge_unit
        pixels = largest * (vision.patch_size * vision.spatial_merge_size) ** 2
        raise ValueError(
            f"mm_processor_kwargs: the processor's max_pixels makes images of up to {max_patches} "
            f"patches, whose tower attention needs {scores / 2**30:.0f} GiB a block of {QUERY_BLOCK} patches "
            f"(at most {MAX_TOWER_SCORES_BYTES / 2**30:.0f}); set --mm-processor-kwargs "
            f"'{{\"max_pixels\": {pixels}}}' or less, or --limit-mm-per-prompt "
            '\'{"image": 0, "video": 0}\' to serve text only'
        )
    buckets = [min(max_patches, 16 * vision.merge_unit)]
    while buckets[-1] < max_patches:
        buckets.append(min(2 * buckets[-1], max_patches))
    return buckets


class PackedPatchesHook(MultiModalHook):
    """Images of any size (Qwen2.5-VL): an image is its (t, h, w) grid of patches, packed with the
    call's other images into the smallest patch-count bucket that holds them (powers of two up to one
    largest image); each token's cache row comes from the host (`pack_images`), so a call writes
    images of several sizes at once and its padding into the scratch slot."""

    def _set_up_encoder(self, cfg, sched) -> list[int]:
        vision: QwenVisionConfig = cfg.vision
        self.vision, self.spatial_merge_size = vision, vision.spatial_merge_size
        self.video_interval = cfg.video_interval
        return patch_buckets(vision, self.tokens_per_item * vision.merge_unit)

    def _max_items_per_step(self) -> int:
        return MAX_ITEMS_PER_CALL

    def _check(self, index: int, feature) -> None:
        t, h, w = feature.grid
        num_patches = t * h * w
        if (
            feature.length * self.vision.merge_unit != num_patches
            or feature.length > self.tokens_per_item
            or tuple(feature.data.shape) != (num_patches, self.vision.patch_dim)
        ):
            raise ValueError(
                f"image {index} has {feature.length} placeholders for a {feature.grid} patch grid of "
                f"pixels {feature.data.shape}; the model takes at most {self.tokens_per_item} tokens of "
                f"{self.vision.merge_unit} patches of {self.vision.patch_dim} values each"
            )

    def _calls(self, items: list) -> list[dict[str, np.ndarray]]:
        calls, pending, num_patches = [], [], 0
        for slot, feature in items:
            patches = len(feature.data)
            if pending and aligned(num_patches) + patches > self.buckets[-1]:
                calls.append(self._pack(pending, next(b for b in self.buckets if b >= num_patches)))
                pending, num_patches = [], 0
            rows = slot * self.tokens_per_item + np.arange(feature.length, dtype=np.int32)
            pending.append((feature.grid, feature.data, rows))
            num_patches = aligned(num_patches) + patches
        if pending:
            calls.append(self._pack(pending, next(b for b in self.buckets if b >= num_patches)))
        return calls

    def _pack(self, images: list, bucket: int) -> dict[str, np.ndarray]:
        inputs = self.vision.pack(images, bucket)
        padding = inputs["dest"] < 0  # the scratch slot's rows, one each
        scratch = self.scratch_slot * self.tokens_per_item + np.arange(len(padding)) % self.tokens_per_item
        inputs["dest"] = np.where(padding, scratch, inputs["dest"]).astype(np.int32)
        return inputs

    def _warm_up_inputs(self, bucket: int) -> dict[str, np.ndarray]:
        return self._pack([], bucket)


def make_mm_hook(runner) -> MultiModalHook | None:
    """The hook of a vision-language model; None for a text-only one, and for a vision-language model
    whose --limit-mm-per-prompt is 0 for every modality (vLLM's text-only mode, `text_only_mode`: no
    encoder program, no encoder cache, no tower weights either, worker/model_loader.py; a text position is
    the same on M-RoPE's three axes, so the decoder rotates as a text-only one does)."""
    n = tokens_per_image(runner.model_config)
    if not n or runner.config.model.text_only_mode:
        return None
    return (PackedPatchesHook if runner.model_config.mrope else MultiModalHook)(runner, n)
