"""Vision-language models: what their decoder takes beside the token ids (the step's encoder outputs),
and the forward every such family shares (`VisionLanguageLM`).

The worker keeps every image's encoder output in one device array, `cache` [num_slots * N, D] (N rows
per image: worker/mm_encoder.py); a step's tokens that are image placeholders say which row replaces
their token embedding. No program is added for it: the merge is a select inside the forward, and a
step of text only passes rows of -1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from xlaserve.models.decoder import DecoderOnlyLM
from xlaserve.models.lora import LoRABatch


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EncoderOutputs:
    # [num_rows, D] every cached image's embeddings, in the decoder's dtype. On a later pipeline stage: the
    # step's own rows [T, D] (row t token t's) where its layers read them (`layers_reading_images`), else
    # None (worker/mm_encoder.py).
    cache: jax.Array | None
    rows: jax.Array  # [T] int32: the row of `cache` that is token t's embedding; -1: its own
    # [T] int32, for a model whose image tokens see their whole image (Gemma 3): positions past its own
    # that token t also attends to (to its image's last token; 0 for text). None for causal models.
    attend_ahead: jax.Array | None = None
    # [3, T] int32, for a model with multimodal rotary positions (Qwen2.5-VL): each token's temporal,
    # height and width positions (models/qwen2_5_vl.py). None for the others.
    mrope: jax.Array | None = None

    def merge(self, x: jax.Array) -> jax.Array:
        """x [T, D] (the token embeddings) with image placeholders replaced by their rows."""
        picked = self.picked()[:, : x.shape[-1]].astype(x.dtype)
        return jnp.where((self.rows >= 0)[:, None], picked, x)

    def picked(self) -> jax.Array:
        """[T, W] each token's cache row (row 0 for text: mask it with `rows >= 0`)."""
        return jnp.take(self.cache, jnp.maximum(self.rows, 0), axis=0)


class VisionLanguageLM(DecoderOnlyLM):
    """A decoder whose image placeholders' embeddings are replaced by an encoder's outputs. A family
    (models/llava.py, models/gemma3_vl.py) builds its tower and projector and says how pixels become the
    rows that replace an image's placeholders (`encode_images`); the engine runs that program on its own
    (worker/mm_encoder.py) and each step passes the rows through `mm`. Whether an image's tokens see
    each other both ways is the config's `bidirectional_images` (then `mm.attend_ahead` bounds them)."""

    def encode_images(self, pixels: jax.Array) -> jax.Array:  # [B, C, H, W] -> [B, N, D_text]
        raise NotImplementedError

    @classmethod
    def layers_reading_images(cls, cfg) -> range:
        """The decoder layers after which `after_layer` reads the image rows (a pipeline stage holding one
        is handed the step's rows: worker/mm_encoder.py); none by default."""
        return range(0)

    def __call__(
        self,
        input_ids: jax.Array,  # [T]
        positions: jax.Array,  # [T]
        kv_cache,
        md,
        lora: LoRABatch | None = None,
        mm: EncoderOutputs | None = None,  # the step's image rows and their spans (worker/mm_encoder.py)
    ):  # -> (hidden [T, D], updated cache)
        x = self.embed(input_ids)
        if mm is not None:
            x = mm.merge(x)
        x, kv_cache = self.run_layers(x, positions, kv_cache, md, lora, mm=mm)
        return self.norm(x), kv_cache

    def run_layers(
        self, x, positions, kv_cache, md, lora=None, layers=None, mm: EncoderOutputs | None = None
    ):
        """`DecoderOnlyLM.run_layers` with what the layers read of the step's images: their attention
        metadata (`image_metadata`) and `after_layer`. A pipeline stage calls it for its own layers, so
        every stage computes what the whole forward computes for them (worker/pipeline_runner.py)."""
        after_layer = None
        if mm is not None:
            md = self.image_metadata(md, mm)
            if mm.cache is not None:
                after_layer = self.after_layer(mm)
        # Only a model that has one passes it: a hybrid backbone's run_layers takes none.
        extra = {} if after_layer is None else {"after_layer": after_layer}
        return super().run_layers(x, positions, kv_cache, md, lora, layers, **extra)

    def image_metadata(self, md, mm: EncoderOutputs):
        """`md` as the step's images change it for every layer: Gemma 3's image spans seen both ways."""
        if mm.attend_ahead is not None:
            md = dataclasses.replace(md, attend_ahead=mm.attend_ahead)
        return md

    def after_layer(self, mm: EncoderOutputs):
        """What runs after each decoder layer, from the step's image rows: nothing, or a function
        (x, layer index) -> x (Qwen3-VL's deepstack features added to its first layers' outputs)."""
        return None
