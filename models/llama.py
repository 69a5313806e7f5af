"""The Llama family (Llama 2/3/3.1/3.2, SmolLM2): RMSNorm, RoPE, GQA, SwiGLU, tied or untied head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kernels import AttentionBackend, AttentionMetadata, KVCache
from models.config import TransformerConfig
from models.layers import Attention, GatedMLP, Linear, RMSNorm


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: TransformerConfig, backend: AttentionBackend, *, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(cfg, backend, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = GatedMLP(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, kv_cache: KVCache, md: AttentionMetadata):
        h, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, md)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv_cache


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(jax.nn.initializers.normal(0.02)(rngs.params(), (vocab_size, dim), dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return self.weight[...][ids]


class LlamaForCausalLM(nnx.Module):
    """Decoder layers are stacked (leading axis = layer) and run under one `lax.scan`.

    One compiled layer body instead of num_layers copies keeps each bucket's compile short,
    which is what makes compiling every bucket at start-up affordable.
    """

    def __init__(self, cfg: TransformerConfig, backend: AttentionBackend, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(cfg, backend, dtype=dtype, rngs=rngs)

        self.layers = make_layers(rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = (
            None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, rngs=rngs)
        )

    def __call__(
        self,
        input_ids: jax.Array,  # [T]
        positions: jax.Array,  # [T]
        kv_cache: KVCache,
        md: AttentionMetadata,
    ) -> tuple[jax.Array, KVCache]:  # hidden [T, D], updated cache
        x = self.embed_tokens(input_ids)
        num_blocks = kv_cache.k.shape[0] // self.cfg.num_layers
        block_size = kv_cache.k.shape[1]
        layer_def, layer_state = nnx.split(self.layers)

        def body(carry, state):
            x, kv_cache, layer = carry
            x, kv_cache = nnx.merge(layer_def, state)(
                x, positions, kv_cache, md.for_layer(layer, num_blocks, block_size)
            )
            return (x, kv_cache, layer + 1), None

        (x, kv_cache, _), _ = jax.lax.scan(body, (x, kv_cache, jnp.int32(0)), layer_state)
        return self.norm(x), kv_cache

    def compute_logits(self, hidden: jax.Array) -> jax.Array:  # [N, D] -> [N, V] float32
        if self.lm_head is None:
            logits = hidden @ self.embed_tokens.weight[...].T
        else:
            logits = self.lm_head(hidden)
        return logits.astype(jnp.float32)
