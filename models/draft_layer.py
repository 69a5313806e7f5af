"""What the one-layer drafting networks share (models/mtp.py's MTP layers, models/eagle3.py's EAGLE-3
network, both driven by worker/mtp.py's step): to the loader each is a model of one attention layer,
unstacked, with a cache of that one layer, and each call reads that layer's slice of the metadata."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from xlaserve.kernels import AttentionMetadata, KVCache, KVCacheSpec
from xlaserve.models.decoder import DecoderOnlyLM
from xlaserve.models.layers import LayerSpec, layer_specs, with_shared_rope


class OneLayerDrafter(nnx.Module):
    """A drafting network over one attention layer with its own K/V; `cfg` is the config its layer
    is shaped by."""

    # The model class whose cache the layer's is one layer of (DeepSeek's MTP: MLA's latent cache).
    cache_model_class: ClassVar[type] = DecoderOnlyLM

    @classmethod
    def kv_cache_spec(cls, cfg) -> KVCacheSpec:
        """One layer of `cache_model_class`'s cache, in `cfg`'s heads and head size."""
        return dataclasses.replace(cls.cache_model_class.kv_cache_spec(cfg), num_layers=1)

    @classmethod
    def layer_stacks(cls, cfg) -> dict[str, range]:
        """None: the one layer's weights load as they are, under no scan."""
        return {}

    def one_layer_inputs(
        self, positions: jax.Array, kv_cache: KVCache, md: AttentionMetadata, spec_layer: int
    ) -> tuple[AttentionMetadata, LayerSpec]:
        """The layer's metadata (the shared rotary tables, the cache's layer 0) and the LayerSpec (rotary
        frequencies, window) of the target's layer `spec_layer`, which the layer reads with."""
        md = with_shared_rope(self.cfg, positions, md)
        spec = jax.tree.map(lambda a: jnp.asarray(a[spec_layer]), layer_specs(self.cfg))
        cache_array = jax.tree.leaves(kv_cache)[0]  # K (or the latent): [num_blocks, block_size, ...]
        return md.for_layer(0, cache_array.shape[0], cache_array.shape[1]), spec
