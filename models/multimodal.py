"""What a vision-language model's decoder takes beside the token ids: the step's encoder outputs.

The worker keeps every image's encoder output in one device array, `cache` [num_slots * N, D] (N rows
per image: worker/mm_encoder.py); a step's tokens that are image placeholders say which row replaces
their token embedding. No program is added for it: the merge is a select inside the forward, and a
step of text only passes rows of -1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EncoderOutputs:
    cache: jax.Array  # [num_rows, D] every cached image's embeddings, in the decoder's dtype
    rows: jax.Array  # [T] int32: the row of `cache` that is token t's embedding; -1: its own
    # [T] int32, for a model whose image tokens see their whole image (Gemma 3): positions past its own
    # that token t also attends to (to its image's last token; 0 for text). None for causal models.
    attend_ahead: jax.Array | None = None

    def merge(self, x: jax.Array) -> jax.Array:
        """x [T, D] (the token embeddings) with image placeholders replaced by their rows."""
        picked = jnp.take(self.cache, jnp.maximum(self.rows, 0), axis=0).astype(x.dtype)
        return jnp.where((self.rows >= 0)[:, None], picked, x)
