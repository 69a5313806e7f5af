"""The decoder-only backbone every family shares: embed, stacked layers under one scan, norm, head.

A family is a decoder layer class plus a subclass naming it:

    class LlamaForCausalLM(DecoderOnlyLM):
        layer_class = LlamaDecoderLayer

`layer_class(cfg, backend, dtype=, rngs=)` builds one layer; calling it as
`layer(x [T, D], positions [T], kv_cache, md, spec) -> (x, kv_cache)` runs it, with `md` already
offset to the layer's KV blocks and `spec` its `LayerSpec` (sliding window, RoPE frequencies).
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from xlaserve.kernels import AttentionBackend, AttentionMetadata, KVCache
from xlaserve.kernels.dtype_ops import scan
from xlaserve.models.config import TransformerConfig
from xlaserve.models.layers import Embedding, Linear, RMSNorm, layer_specs, soft_cap


class DecoderOnlyLM(nnx.Module):
    """Decoder layers are stacked (leading axis = layer) and run under one `lax.scan`.

    One compiled layer body instead of num_layers copies keeps each bucket's compile short,
    which is what makes compiling every bucket at start-up affordable. What differs between
    layers rides along the scan as a `LayerSpec`, so alternating layers do not unroll it.
    """

    layer_class: ClassVar[type[nnx.Module]]

    def __init__(
        self, cfg: TransformerConfig, backend: AttentionBackend, *, dtype=jnp.float32, rngs: nnx.Rngs
    ):
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        layer_class = type(self).layer_class

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs: nnx.Rngs) -> nnx.Module:
            return layer_class(cfg, backend, dtype=dtype, rngs=rngs)

        self.layers = make_layers(rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=cfg.norm_offset, dtype=dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, rngs=rngs)
        )

    def __call__(
        self,
        input_ids: jax.Array,  # [T]
        positions: jax.Array,  # [T]
        kv_cache: KVCache,
        md: AttentionMetadata,
    ) -> tuple[jax.Array, KVCache]:  # hidden [T, D], updated cache
        cfg = self.cfg
        x = self.embed_tokens(input_ids)
        if cfg.embed_scale != 1.0:  # Gemma; the scale is rounded to the weights' dtype, as HF does
            x = x * jnp.asarray(cfg.embed_scale, x.dtype)
        num_blocks = kv_cache.k.shape[0] // cfg.num_layers
        block_size = kv_cache.k.shape[1]
        specs = jax.tree.map(jnp.asarray, layer_specs(cfg))
        layer_def, layer_state = nnx.split(self.layers)

        def body(carry, xs):
            x, kv_cache = carry
            state, spec = xs
            md_layer = md.for_layer(spec.index, num_blocks, block_size)
            x, kv_cache = nnx.merge(layer_def, state)(x, positions, kv_cache, md_layer, spec)
            return (x, kv_cache), None

        (x, kv_cache), _ = scan(body, (x, kv_cache), (layer_state, specs))
        return self.norm(x), kv_cache

    def compute_logits(self, hidden: jax.Array) -> jax.Array:  # [N, D] -> [N, V] float32
        # float32 straight from the accumulator: bfloat16 logits would blur near-ties and logprobs.
        if self.lm_head is None:
            logits = self.embed_tokens.attend(hidden)
        else:
            logits = self.lm_head(hidden, out_dtype=jnp.float32)
        return soft_cap(logits.astype(jnp.float32), self.cfg.final_logit_softcap)
