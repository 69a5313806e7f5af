"""The backbone of hybrid models: attention layers beside recurrent ones (Qwen3.5's Gated DeltaNet,
Granite 4.0-H's Mamba2), each layer one or the other, or both side by side (Falcon-H1's parallel
layers: attention and Mamba2 on the same input, summed).

config.json's `layer_types` says which mixer each layer has (`HybridConfig.mixer_types`; the base
class's `layer_types` is about sliding windows). The layers repeat a period (Qwen3.5: three linear
layers, then an attention layer; Granite 4.0-H: attention as the sixth of every ten), so they form
one stack per position in the period (`linear_layers_0`, ..., `attention_layers_0`, ...: each layer
under Hugging Face's `model.layers.{i}` of its own id), run under one `lax.scan` over periods: each
step of the scan runs one period's layers in order, one from each stack. A pipeline stage's layers may
start inside a period: it runs rounds of the period rotated to its first layer (`run_layers`). The
cache is a `HybridCache` (kernels/hybrid_cache.py): an attention layer reads and writes its K/V by
block id (the step's block table), a recurrent layer its state by slot (the step's `state_slots`).
LoRA adapters bind to a layer's projections by path, as in the plain decoder (models/lora.py); a
family whose layer classes declare `supports_lora` takes them on its attention and MLP projections.

A family gives its config class (a `HybridConfig`), its layer classes and its cache spec:

    linear layer:    layer(x, cache, md, rows) -> (x, cache); rows [R]: each sequence's state row
    attention layer: layer(x, positions, cache, md, spec) -> (x, cache); md offset to its blocks
    parallel layer:  layer(x, positions, cache, md, spec, rows) -> (x, cache): both
A parallel layer counts as an attention layer (its K/V) and as a recurrent one (its state slot).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.kernels import AttentionBackend, AttentionMetadata
from xlaserve.kernels.dtype_ops import stack_entry
from xlaserve.kernels.hybrid_cache import HybridCache, HybridCacheSpec
from xlaserve.models.config import TransformerConfig
from xlaserve.models.decoder import DecoderOnlyLM
from xlaserve.models.layers import LayerSpec, layer_specs, with_shared_rope
from xlaserve.models.lora import LoRABatch, bind_adapters

LINEAR, FULL, PARALLEL = "linear_attention", "full_attention", "parallel"
# config.json spellings of each kind (Granite 4.0-H's checkpoints write "mamba" and "attention",
# Falcon-H1's "hybrid").
_KIND_SPELLINGS = {
    "linear_attention": LINEAR,
    "mamba": LINEAR,
    "full_attention": FULL,
    "attention": FULL,
    "hybrid": PARALLEL,
}
_STACK_PREFIX = {LINEAR: "linear_layers", FULL: "attention_layers", PARALLEL: "parallel_layers"}
_HAS_ATTENTION, _HAS_STATE = (FULL, PARALLEL), (LINEAR, PARALLEL)


@dataclass(frozen=True)
class HybridConfig(TransformerConfig):
    mixer_types: tuple[str, ...] = ()  # per layer LINEAR (a recurrent mixer), FULL (attention) or PARALLEL

    def __post_init__(self):
        super().__post_init__()
        kinds = set(self.mixer_types)
        if len(self.mixer_types) != self.num_layers or kinds - {LINEAR, FULL, PARALLEL}:
            raise ValueError(
                f"layer_types must give each of the {self.num_layers} layers a recurrent mixer "
                f"({LINEAR!r}), attention ({FULL!r}) or both ({PARALLEL!r}), got {list(self.mixer_types)}"
            )
        if PARALLEL not in kinds and (FULL not in kinds or LINEAR not in kinds):
            raise ValueError(
                f"layer_types must mix {LINEAR!r} and {FULL!r} layers, got {list(self.mixer_types)}"
            )

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        fields = super().fields_from_hf(hf)
        num_layers = hf["num_hidden_layers"]
        kinds = hf.get("layer_types") or hf.get("layers_block_type")
        if not kinds:  # Qwen3.5's default: attention every full_attention_interval layers
            interval = hf.get("full_attention_interval", 4)
            kinds = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)]
        unknown = sorted(set(kinds) - set(_KIND_SPELLINGS))
        if unknown:
            raise ValueError(f"layer_types {unknown} are not supported: expected {sorted(_KIND_SPELLINGS)}")
        return {**fields, "mixer_types": tuple(_KIND_SPELLINGS[k] for k in kinds)}

    @property
    def period(self) -> tuple[str, ...]:
        """The shortest run of layer kinds that the layers repeat."""
        kinds, n = self.mixer_types, self.num_layers
        return next(kinds[:p] for p in range(1, n + 1) if n % p == 0 and kinds == kinds[:p] * (n // p))

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        """The layers with K/V in the cache: attention and parallel ones."""
        return tuple(i for i, t in enumerate(self.mixer_types) if t in _HAS_ATTENTION)

    @property
    def state_layer_ids(self) -> tuple[int, ...]:
        """The layers with a state slot: recurrent and parallel ones."""
        return tuple(i for i, t in enumerate(self.mixer_types) if t in _HAS_STATE)


def hybrid_cache_spec(
    cfg: HybridConfig, *, conv_kernel: int, conv_dim: int, recurrent_shape
) -> HybridCacheSpec:
    """The cache of `cfg`'s attention and state layers: the families differ only in their mixer's conv
    and recurrent state."""
    return HybridCacheSpec(
        attention_layers=cfg.attention_layer_ids,
        state_layers=cfg.state_layer_ids,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        conv_kernel=conv_kernel,
        conv_dim=conv_dim,
        recurrent_shape=tuple(recurrent_shape),
    )


class HybridDecoderLM(DecoderOnlyLM):
    config_class: ClassVar[type[HybridConfig]] = HybridConfig
    linear_layer_class: ClassVar[type[nnx.Module]]
    attention_layer_class: ClassVar[type[nnx.Module]]
    parallel_layer_class: ClassVar[type[nnx.Module]]

    @classmethod
    def layer_classes(cls) -> tuple[type[nnx.Module], ...]:
        names = ("linear_layer_class", "attention_layer_class", "parallel_layer_class")
        return tuple(getattr(cls, name) for name in names if hasattr(cls, name))

    @classmethod
    def layer_stacks(cls, cfg: HybridConfig) -> dict[str, tuple[int, ...]]:
        """One stack per position in the period (`linear_layers_0`, ..., `attention_layers_0`, ...),
        each holding that position's layer of every period: the scan over periods slices one layer
        from each stack, as the plain decoder's scan slices its one stack."""
        period, num_periods = cfg.period, cfg.num_layers // len(cfg.period)
        stacks, counts = {}, {LINEAR: 0, FULL: 0, PARALLEL: 0}
        for j, kind in enumerate(period):
            name = f"{_STACK_PREFIX[kind]}_{counts[kind]}"
            counts[kind] += 1
            stacks[name] = tuple(p * len(period) + j for p in range(num_periods))
        return stacks

    @classmethod
    def make_layer(cls, cfg, backend: AttentionBackend, stack: str, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        if stack.startswith(_STACK_PREFIX[LINEAR]):
            return cls.linear_layer_class(cfg, backend, dtype=dtype, rngs=rngs)
        if stack.startswith(_STACK_PREFIX[PARALLEL]):
            return cls.parallel_layer_class(cfg, backend, dtype=dtype, rngs=rngs)
        return cls.attention_layer_class(cfg, backend, dtype=dtype, rngs=rngs)

    def run_layers(
        self,
        x: jax.Array,  # [T, D]
        positions: jax.Array,  # [T]
        kv_cache: HybridCache,
        md: AttentionMetadata,
        lora: LoRABatch | None = None,
        layers: range | None = None,
    ):  # -> (x [T, D], updated cache)
        """x through the layers `layers` (None: all of them; a pipeline stage's range, which may start and end
        inside a period: worker/pipeline_stage.py). No `after_layer` (`DecoderOnlyLM.run_layers`'s): no hybrid
        model adds image features between layers (Qwen3.5's tower has no DeepStack). The range is run as
        rounds of the period rotated to start at its first layer, under one scan, then the rest of a round
        unrolled: round q's layer k is entry q of its stack's part in the range (the stage's weights, LoRA
        slots), and its K/V and state rows come after those of the range's layers before it (the stage's cache
        holds only its layers')."""
        cfg = self.cfg
        layers = range(cfg.num_layers) if layers is None else layers
        period, stacks = cfg.period, self.layer_stacks(cfg)
        # The rotated period: (stack, kind, attention and state layers before it in a round) per layer.
        shift = layers.start % len(period)
        rotated, num_attention, num_state = [], 0, 0
        for k in range(len(period)):
            j = (shift + k) % len(period)
            rotated.append((list(stacks)[j], period[j], num_attention, num_state))
            num_attention += period[j] in _HAS_ATTENTION
            num_state += period[j] in _HAS_STATE
        num_rounds, num_rest = divmod(len(layers), len(period))
        # The cache holds the range's layers only: its blocks and slots per layer.
        range_kinds = [cfg.mixer_types[i] for i in layers]
        num_blocks = kv_cache.k.shape[0] // max(1, sum(t in _HAS_ATTENTION for t in range_kinds))
        num_slots = kv_cache.conv.shape[0] // max(1, sum(t in _HAS_STATE for t in range_kinds))
        block_size = kv_cache.k.shape[1]
        md = with_shared_rope(cfg, positions, md)  # once per step, for every attention layer
        defs = {name: nnx.split(getattr(self, name)) for name in stacks}
        all_specs = layer_specs(cfg)  # what an attention layer reads per layer (a recurrent one: nothing)
        slot_mask = None if lora is None else lora.slot_mask()  # once per step, for every layer

        def run_layer(x, cache, q, k, spec):
            """Layer k of round q (q traced under the scan, an int for the rest)."""
            name, kind, attention_before, state_before = rotated[k]
            graphdef, stack = defs[name]
            layer = nnx.merge(graphdef, stack_entry(stack, q, words_of=x.dtype))
            if lora is not None and name in lora.stacks:  # its slots, bound to its projections for this step
                bind_adapters(layer, stack_entry(lora.stacks[name], q, words_of=x.dtype), slot_mask)
            rows = (q * num_state + state_before) * num_slots + md.state_slots  # its state rows
            md_layer = md.for_layer(q * num_attention + attention_before, num_blocks, block_size)
            if kind == LINEAR:
                x, cache = layer(x, cache, md, rows)
            elif kind == FULL:
                x, cache = layer(x, positions, cache, md_layer, spec)
            else:
                x, cache = layer(x, positions, cache, md_layer, spec, rows)
            # Each layer's output is rounded to x's dtype here, whatever layer follows: XLA may keep a
            # 16-bit value in float32 between fused ops, so without the barrier a layer boundary inside a
            # round (one layout) and one between rounds or stages (another) would differ in bits.
            return jax.lax.optimization_barrier(x), cache

        def specs_of(k: int, rounds) -> LayerSpec:  # [len(rounds), ...]: layer k's of those rounds
            ids = [layers.start + q * len(period) + k for q in rounds]
            return jax.tree.map(lambda a: jnp.asarray(np.asarray(a)[ids]), all_specs)

        def body(carry, xs):
            x, cache = carry
            q, specs = xs
            for k in range(len(period)):
                x, cache = run_layer(x, cache, q, k, specs[k])
            return (x, cache), None

        if num_rounds:
            specs = tuple(specs_of(k, range(num_rounds)) for k in range(len(period)))
            xs = (jnp.arange(num_rounds, dtype=jnp.int32), specs)
            (x, kv_cache), _ = jax.lax.scan(body, (x, kv_cache), xs)
        for k in range(num_rest):  # the range ends inside a round
            spec = jax.tree.map(lambda a: a[0], specs_of(k, [num_rounds]))
            x, kv_cache = run_layer(x, kv_cache, num_rounds, k, spec)
        return x, kv_cache
