"""The backbone of hybrid models: attention layers beside recurrent ones (Qwen3.5's Gated DeltaNet,
Granite 4.0-H's Mamba2), each layer one or the other, or both side by side (Falcon-H1's parallel
layers: attention and Mamba2 on the same input, summed).

config.json's `layer_types` says which mixer each layer has (`HybridConfig.mixer_types`; the base
class's `layer_types` is about sliding windows). The layers repeat a period (Qwen3.5: three linear
layers, then an attention layer; Granite 4.0-H: attention as the sixth of every ten), so they form
one stack per position in the period (`linear_layers_0`, ..., `attention_layers_0`, ...: each layer
under Hugging Face's `model.layers.{i}` of its own id), run under one `lax.scan` over periods: each
step of the scan runs one period's layers in order, one from each stack. The cache is a `HybridCache`
(kernels/hybrid_cache.py): an attention layer reads and writes its K/V by block id (the step's block
table), a recurrent layer its state by slot (the step's `state_slots`).

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
from xlaserve.kernels.dtype_ops import scan
from xlaserve.kernels.hybrid_cache import HybridCache, HybridCacheSpec
from xlaserve.models.config import TransformerConfig
from xlaserve.models.decoder import DecoderOnlyLM
from xlaserve.models.layers import layer_specs, with_shared_rope

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

    def run_layers(self, x, positions, kv_cache: HybridCache, md: AttentionMetadata, lora=None, layers=None):
        cfg = self.cfg
        if lora is not None:
            raise ValueError(f"LoRA adapters are not supported for {cfg.architecture}")
        if layers is not None and layers != range(cfg.num_layers):
            raise ValueError(f"pipeline stages are not supported for {cfg.architecture}")
        period = cfg.period
        num_periods = cfg.num_layers // len(period)
        num_linear = sum(kind in _HAS_STATE for kind in period)
        num_attention = sum(kind in _HAS_ATTENTION for kind in period)
        num_blocks = kv_cache.k.shape[0] // (num_periods * num_attention)
        block_size = kv_cache.k.shape[1]
        num_slots = kv_cache.conv.shape[0] // (num_periods * num_linear)
        md = with_shared_rope(cfg, positions, md)  # once per step, for every attention layer
        stacks = self.layer_stacks(cfg)
        defs, states = zip(*(nnx.split(getattr(self, name)) for name in stacks))
        all_specs = layer_specs(cfg)  # what an attention layer reads per layer (a recurrent one: nothing)
        specs = tuple(
            jax.tree.map(lambda a, ids=list(ids): jnp.asarray(np.asarray(a)[ids]), all_specs)
            if kind in _HAS_ATTENTION
            else None
            for kind, ids in zip(period, stacks.values())
        )

        def body(carry, xs):
            x, cache = carry
            states, specs, p = xs
            i_linear = i_attention = 0
            for j, kind in enumerate(period):
                layer = nnx.merge(defs[j], states[j])
                rows = (p * num_linear + i_linear) * num_slots + md.state_slots  # its state rows
                md_layer = md.for_layer(p * num_attention + i_attention, num_blocks, block_size)
                if kind == LINEAR:
                    x, cache = layer(x, cache, md, rows)
                elif kind == FULL:
                    x, cache = layer(x, positions, cache, md_layer, specs[j])
                else:
                    x, cache = layer(x, positions, cache, md_layer, specs[j], rows)
                i_linear += kind in _HAS_STATE
                i_attention += kind in _HAS_ATTENTION
            return (x, cache), None

        xs = (states, specs, jnp.arange(num_periods, dtype=jnp.int32))
        (x, kv_cache), _ = scan(body, (x, kv_cache), xs, words_of=x.dtype)
        return x, kv_cache
