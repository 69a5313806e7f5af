"""The decoder-only backbone every family shares: embed, stacked layers under `lax.scan`, norm, head.

`DecoderOnlyLM` implements the `CausalLM` protocol (models/interfaces.py) with Llama's defaults. A
family is a decoder layer class plus a subclass naming it, and whatever else it changes:

    class LlamaForCausalLM(DecoderOnlyLM):
        layer_class = LlamaDecoderLayer

`layer_class(cfg, backend, dtype=, rngs=)` builds one layer; calling it as
`layer(x [T, D], positions [T], kv_cache, md, spec) -> (x, kv_cache)` runs it, with `md` already
offset to the layer's KV blocks and `spec` its `LayerSpec` (sliding window, RoPE frequencies). The
backbone never looks inside `kv_cache`: each layer's attention reads and writes its own entries (K
and V, or MLA's latent), so a family with another cache (DeepSeek) reuses this backbone as it is.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.kernels import AttentionBackend, AttentionMetadata, KVCacheSpec
from xlaserve.kernels.dtype_ops import matmul, scan
from xlaserve.models.config import TransformerConfig
from xlaserve.models.layers import (
    Embedding,
    LayerSpec,
    Linear,
    RMSNorm,
    layer_specs,
    soft_cap,
    with_shared_rope,
)
from xlaserve.models.lora import LoRABatch, bind_adapters


class DecoderOnlyLM(nnx.Module):
    """Decoder layers are stacked (leading axis = layer) and run under one `lax.scan` per stack.

    One compiled layer body instead of num_layers copies keeps each bucket's compile short,
    which is what makes compiling every bucket at start-up affordable. What differs between
    layers rides along the scan as a `LayerSpec`, so alternating layers do not unroll it. A family
    whose layers differ in structure (DeepSeek: dense MLP layers, then MoE layers) has one stack
    per kind (`layer_stacks`, `make_layer`), each under its own scan.
    """

    config_class: ClassVar[type[TransformerConfig]] = TransformerConfig
    layer_class: ClassVar[type[nnx.Module]]
    tensor_parallel_unsupported: ClassVar[str | None] = None  # models/interfaces.py
    encoder_modules: ClassVar[tuple[str, ...]] = ()  # models/interfaces.py

    def __init__(
        self, cfg: TransformerConfig, backend: AttentionBackend, *, dtype=jnp.float32, rngs: nnx.Rngs
    ):
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        for name, layers in self.layer_stacks(cfg).items():
            setattr(self, name, self._make_stack(cfg, backend, name, len(layers), dtype=dtype, rngs=rngs))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=cfg.norm_offset, dtype=dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, rngs=rngs)
        )

    # -- hooks (the CausalLM protocol's defaults) ---------------------------------------------------

    @classmethod
    def kv_cache_spec(cls, cfg: TransformerConfig) -> KVCacheSpec:
        """K and V of [num_kv_heads, head_dim] per layer."""
        return KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)

    @classmethod
    def layer_classes(cls) -> tuple[type[nnx.Module], ...]:
        """The decoder layer classes the model builds (LoRA asks each for `supports_lora`)."""
        return tuple(c for c in (getattr(cls, "layer_class", None),) if c is not None)

    @classmethod
    def layer_stacks(cls, cfg: TransformerConfig) -> dict[str, range]:
        """One stack, `layers`, holding every layer."""
        return {"layers": range(cfg.num_layers)}

    @classmethod
    def prepare_hf_tensors(
        cls, cfg: TransformerConfig, tensors: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """The checkpoint as it is: our modules are named as Hugging Face's."""
        return tensors

    @classmethod
    def make_layer(
        cls, cfg: TransformerConfig, backend: AttentionBackend, stack: str, *, dtype, rngs: nnx.Rngs
    ) -> nnx.Module:
        """One decoder layer of `stack` (a key of `layer_stacks`): a `layer_class`."""
        return cls.layer_class(cfg, backend, dtype=dtype, rngs=rngs)

    @classmethod
    def _make_stack(cls, cfg, backend, stack: str, num_layers: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        @nnx.split_rngs(splits=num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs: nnx.Rngs) -> nnx.Module:
            return cls.make_layer(cfg, backend, stack, dtype=dtype, rngs=rngs)

        return make_layers(rngs)

    # -- forward ----------------------------------------------------------------------------------

    def __call__(
        self,
        input_ids: jax.Array,  # [T]
        positions: jax.Array,  # [T]
        kv_cache,  # the cache_class of kv_cache_spec(cfg)
        md: AttentionMetadata,
        lora: LoRABatch | None = None,  # adapter slots and each token's slot (models/lora.py)
        aux_layers: jax.Array | None = None,  # [n] int32, ascending: `run_layers`'s
    ):  # -> (hidden [T, D], updated cache), and the aux hidden states [T, n * D] when asked for
        if aux_layers is None:
            x, kv_cache = self.run_layers(self.embed(input_ids), positions, kv_cache, md, lora)
            return self.norm(x), kv_cache
        x, kv_cache, aux = self.run_layers(
            self.embed(input_ids), positions, kv_cache, md, lora, aux_layers=aux_layers
        )
        return self.norm(x), kv_cache, jnp.moveaxis(aux, 0, 1).reshape(x.shape[0], -1)

    def embed(self, input_ids: jax.Array) -> jax.Array:  # [T] -> [T, D]
        x = self.embed_tokens(input_ids)
        if self.cfg.embed_scale != 1.0:  # Gemma; the scale is rounded to the weights' dtype, as HF does
            x = x * jnp.asarray(self.cfg.embed_scale, x.dtype)
        return x

    def run_layers(
        self,
        x: jax.Array,  # [T, D]
        positions: jax.Array,  # [T]
        kv_cache,
        md: AttentionMetadata,
        lora: LoRABatch | None = None,
        layers: range | None = None,
        after_layer=None,
        aux_layers: jax.Array | None = None,
    ):  # -> (x [T, D], updated cache), and the aux hidden states [n, T, D] when asked for
        """x through the decoder layers `layers` (None: all of them). A pipeline stage runs its own
        contiguous range (worker/pipeline_stage.py): its stacks hold only those layers' weights (each
        stack sliced to its overlap with the range) and `kv_cache` only their blocks, so each layer's
        block offset counts from the range's first layer. `after_layer(x, layer_index) -> x`, when given,
        runs after every layer inside the scan (Qwen3-VL adds image features to its first layers').
        `aux_layers` [n] int32: also return the residual stream entering each of those layers (vLLM's
        aux hidden states, an EAGLE-3 drafter's input: worker/eagle3.py), picked inside the scan."""
        cfg = self.cfg
        layers = range(cfg.num_layers) if layers is None else layers
        # Every array of the cache is [len(layers) * num_blocks, block_size, ...].
        cache_array = jax.tree.leaves(kv_cache)[0]
        num_blocks = cache_array.shape[0] // len(layers)
        block_size = cache_array.shape[1]
        specs = layer_specs(cfg)
        specs = dataclasses.replace(specs, index=specs.index - np.int32(layers.start))
        md = with_shared_rope(cfg, positions, md)  # once per step, not in every layer
        slot_mask = None if lora is None else lora.slot_mask()  # once per step, for every layer
        aux = None if aux_layers is None else jnp.zeros((aux_layers.shape[0], *x.shape), x.dtype)
        for name, stack_layers in self.layer_stacks(cfg).items():
            start, stop = max(stack_layers.start, layers.start), min(stack_layers.stop, layers.stop)
            if start >= stop:  # none of this stack's layers in the range (its weights: an empty slice)
                continue
            stack_specs = jax.tree.map(lambda a, lo=start, hi=stop: jnp.asarray(a[lo:hi]), specs)
            stack_lora = None if lora is None else (lora.stacks[name], slot_mask)
            x, kv_cache, aux = _run_stack(
                getattr(self, name),
                x,
                positions,
                kv_cache,
                md,
                stack_specs,
                num_blocks,
                block_size,
                stack_lora,
                after_layer,
                layers.start,
                aux_layers,
                aux,
            )
        return (x, kv_cache) if aux is None else (x, kv_cache, aux)

    def compute_logits(self, hidden: jax.Array, head_dv: jax.Array | None = None) -> jax.Array:
        """[N, D] -> [N, V] float32. `head_dv`: the LM head's weight as [D, V], when the caller keeps
        one (the tied embedding, transposed once: see worker/model_loader.py)."""
        # float32 straight from the accumulator: bfloat16 logits would blur near-ties and logprobs.
        if head_dv is not None:
            logits = matmul(hidden, head_dv, jnp.float32)
        elif self.lm_head is None:
            logits = self.embed_tokens.attend(hidden)
        else:
            logits = self.lm_head(hidden, out_dtype=jnp.float32)
        return soft_cap(logits.astype(jnp.float32), self.cfg.final_logit_softcap)


def _run_stack(
    stack: nnx.Module,
    x: jax.Array,  # [T, D]
    positions: jax.Array,  # [T]
    kv_cache,
    md: AttentionMetadata,
    specs: LayerSpec,  # [num_layers_in_stack, ...] each
    num_blocks: int,
    block_size: int,
    lora=None,  # (LoRAWeights [num_layers_in_stack, ...], SlotMask) or None: no adapters
    after_layer=None,  # (x, layer index) -> x, run after each layer (`run_layers`)
    first_layer: int = 0,  # the HF index of the range's first layer (specs' indices count from it)
    aux_layers=None,  # [n] int32 HF layer indices, or None
    aux=None,  # [n, T, D]: row j takes x as it enters layer aux_layers[j]
):
    """x through every layer of `stack` under one scan; each layer sees the metadata of its blocks.
    Adapter slots, when given, are scanned with the layer weights: each layer gets its own.
    -> (x, kv_cache, aux)."""
    layer_def, layer_state = nnx.split(stack)
    lora_weights, slot_mask = (None, None) if lora is None else lora

    def body(carry, xs):
        x, kv_cache, aux = carry
        state, spec, weights = xs
        if aux is not None:
            entering = (aux_layers == spec.index + first_layer)[:, None, None]
            aux = jnp.where(entering, x[None], aux)
        md_layer = md.for_layer(spec.index, num_blocks, block_size)
        layer = nnx.merge(layer_def, state)
        if weights is not None:  # this layer's slots, bound to its projections for this step
            bind_adapters(layer, weights, slot_mask)
        x, kv_cache = layer(x, positions, kv_cache, md_layer, spec)
        if after_layer is not None:
            x = after_layer(x, spec.index + first_layer)
        return (x, kv_cache, aux), None

    # dtype_ops.scan: 16-bit weights sliced as words on CPU, where XLA would convert the whole stack.
    carry = (x, kv_cache, aux)
    (x, kv_cache, aux), _ = scan(body, carry, (layer_state, specs, lora_weights), words_of=x.dtype)
    return x, kv_cache, aux
