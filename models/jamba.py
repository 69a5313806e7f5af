"""Jamba (JambaForCausalLM): Mamba (v1) layers beside attention layers, a mixture of experts in every
other layer.

On the hybrid backbone (models/hybrid.py): attention every `attn_layer_period` layers from
`attn_layer_offset` (no position embedding: the Mamba layers carry the order), Mamba elsewhere; the
feed-forward of every `expert_layer_period`-th layer from `expert_layer_offset` is a routed mixture
(a softmax over all experts, the top k kept with their weights as they are), a SwiGLU MLP elsewhere.
The layers repeat with the period of both patterns together, one stack per position in it.

The Mamba layers are Mamba (v1)'s mixer (models/mamba.py) with RMS norms on the time step, B and C
(Jamba's addition), their conv inputs and [D, 1, N] state in the layer's state slot.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx

from xlaserve.kernels import AttentionBackend, AttentionMetadata, KVCache
from xlaserve.kernels.hybrid_cache import HybridCache, HybridCacheSpec
from xlaserve.kernels.ssd import MambaCache
from xlaserve.models.config import TransformerConfig
from xlaserve.models.hybrid import LINEAR, HybridConfig, HybridDecoderLM, hybrid_cache_spec
from xlaserve.models.layers import Attention, GatedMLP, LayerSpec, RMSNorm
from xlaserve.models.mamba import MAMBA_TP_UNSUPPORTED, MambaConfig, MambaMixer
from xlaserve.models.moe import MoEConfig, SparseMoeBlock, stack_expert_tensors


@dataclass(frozen=True)
class JambaConfig(MoEConfig, HybridConfig):
    moe_layers: tuple[int, ...] = ()  # the layers whose feed-forward is the mixture of experts
    mamba_d_state: int = 16  # N
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_dt_rank: int = 0
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False

    def __post_init__(self):
        if not self.moe_layers:  # a dense Jamba: no routing to check
            HybridConfig.__post_init__(self)
        else:
            super().__post_init__()

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        n = hf["num_hidden_layers"]
        attn_period, attn_offset = hf.get("attn_layer_period", 8), hf.get("attn_layer_offset", 4)
        moe_period, moe_offset = hf.get("expert_layer_period", 2), hf.get("expert_layer_offset", 1)
        kinds = ["attention" if i % attn_period == attn_offset else "mamba" for i in range(n)]
        num_experts = hf.get("num_experts", 16)
        moe_layers = tuple(i for i in range(n) if i % moe_period == moe_offset) if num_experts > 1 else ()
        fields = super().fields_from_hf({**hf, "layer_types": kinds})
        dt_rank = hf.get("mamba_dt_rank", "auto")
        return {
            **fields,
            "num_experts": num_experts,
            "norm_topk_prob": False,  # the top k softmax weights as they are
            "partial_rotary_factor": 0.0,  # no position embedding
            "moe_layers": moe_layers,
            "mamba_d_state": hf.get("mamba_d_state", 16),
            "mamba_d_conv": hf.get("mamba_d_conv", 4),
            "mamba_expand": hf.get("mamba_expand", 2),
            "mamba_dt_rank": math.ceil(hf["hidden_size"] / 16) if dt_rank == "auto" else dt_rank,
            "mamba_conv_bias": bool(hf.get("mamba_conv_bias", True)),
            "mamba_proj_bias": bool(hf.get("mamba_proj_bias", False)),
        }

    @property
    def period(self) -> tuple[str, ...]:
        """The mixers of the shortest run of layers that repeats in both the mixer and the
        feed-forward patterns (a stack's layers share both)."""
        kinds = [(t, i in self.moe_layers) for i, t in enumerate(self.mixer_types)]
        n = self.num_layers
        p = next(p for p in range(1, n + 1) if n % p == 0 and kinds == kinds[:p] * (n // p))
        return self.mixer_types[:p]

    @property
    def mamba_inner(self) -> int:
        return self.mamba_expand * self.hidden_size

    @property
    def mamba(self) -> MambaConfig:
        """The Mamba mixer's config: the shared fields, its widths, and the time step, B and C norms."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(TransformerConfig)}
        return MambaConfig(
            **{**shared, "intermediate_size": self.mamba_inner},
            state_size=self.mamba_d_state,
            conv_kernel=self.mamba_d_conv,
            time_step_rank=self.mamba_dt_rank,
            use_conv_bias=self.mamba_conv_bias,
            use_bias=self.mamba_proj_bias,
            bc_norms=True,
        )


class _JambaLayer(nnx.Module):
    """The norms and the feed-forward (experts or a SwiGLU MLP) every layer has."""

    def __init__(self, cfg: JambaConfig, is_moe: bool, *, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        ffn = SparseMoeBlock if is_moe else GatedMLP
        self.feed_forward = ffn(cfg, dtype=dtype, rngs=rngs)

    def finish(self, x: jax.Array, h: jax.Array) -> jax.Array:
        x = x + h
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class JambaMambaLayer(_JambaLayer):
    def __init__(self, cfg: JambaConfig, is_moe: bool, *, dtype, rngs: nnx.Rngs):
        super().__init__(cfg, is_moe, dtype=dtype, rngs=rngs)
        self.mamba = MambaMixer(cfg.mamba, dtype=dtype, rngs=rngs)

    def __call__(self, x, cache: HybridCache, md: AttentionMetadata, rows: jax.Array):
        h, state = self.mamba(self.input_layernorm(x), MambaCache(cache.conv, cache.recurrent), md, rows)
        return self.finish(x, h), HybridCache(cache.k, cache.v, state.conv, state.ssm)


class JambaAttentionLayer(_JambaLayer):
    def __init__(self, cfg: JambaConfig, is_moe: bool, backend: AttentionBackend, *, dtype, rngs: nnx.Rngs):
        super().__init__(cfg, is_moe, dtype=dtype, rngs=rngs)
        self.self_attn = Attention(cfg, backend, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, cache: HybridCache, md: AttentionMetadata, spec: LayerSpec):
        h, kv = self.self_attn(self.input_layernorm(x), positions, KVCache(cache.k, cache.v), md, spec)
        return self.finish(x, h), HybridCache(kv.k, kv.v, cache.conv, cache.recurrent)


class JambaForCausalLM(HybridDecoderLM):
    config_class = JambaConfig
    tensor_parallel_unsupported = MAMBA_TP_UNSUPPORTED

    @classmethod
    def make_layer(cls, cfg: JambaConfig, backend: AttentionBackend, stack: str, *, dtype, rngs: nnx.Rngs):
        first = cls.layer_stacks(cfg)[stack][0]  # every layer of a stack has its mixer and feed-forward
        is_moe = first in cfg.moe_layers
        if cfg.mixer_types[first] == LINEAR:
            return JambaMambaLayer(cfg, is_moe, dtype=dtype, rngs=rngs)
        return JambaAttentionLayer(cfg, is_moe, backend, dtype=dtype, rngs=rngs)

    @classmethod
    def kv_cache_spec(cls, cfg: JambaConfig) -> HybridCacheSpec:
        return hybrid_cache_spec(
            cfg,
            conv_kernel=cfg.mamba_d_conv,
            conv_dim=cfg.mamba_inner,
            # Mamba2's [H, P, N] layout with a head per channel (P = 1): the cache's arrays are all 4-D.
            recurrent_shape=(cfg.mamba_inner, 1, cfg.mamba_d_state),
        )

    @classmethod
    def prepare_hf_tensors(cls, cfg: JambaConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Per-expert tensors stacked; the router is our `gate`; `final_layernorm` the decoder's `norm`."""
        renamed = {}
        for name, tensor in tensors.items():
            name = name.replace(".feed_forward.router.", ".feed_forward.gate.")
            renamed[name.replace("model.final_layernorm.", "model.norm.")] = tensor
        return stack_expert_tensors(renamed, cfg.num_experts)
