"""Mamba (v1: MambaForCausalLM): every layer a selective SSM mixer over a per-request state, no attention;
its mixer is also Jamba's (models/jamba.py).

The mixer: in_proj gives x and the gate z; a causal depthwise conv and silu over x; x_proj gives the
time step's low-rank input, B and C (Jamba RMS-norms each); dt_proj widens the time step, softplus;
the selective scan (kernels/selective_scan.py) over the state [D, N]; y * silu(z); out_proj. Its
state is kept in Mamba2's [H, P, N] layout with a head per channel (H = D, P = 1), so the cache is
Mamba2's `MambaCache` (kernels/ssd.py): per layer and slot, the last K - 1 conv inputs and the state.
A request's slot is its one block id (core/kv_cache_spec.py `StateSpec`), as for Mamba2.

Hugging Face names the backbone `backbone` (embeddings, layers, norm_f): renamed as for Mamba2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.kernels import AttentionBackend, AttentionMetadata
from xlaserve.kernels.selective_scan import ragged_selective_scan
from xlaserve.kernels.ssd import MambaCache, StateCacheSpec, entering_states, ragged_causal_conv1d
from xlaserve.models.config import TransformerConfig
from xlaserve.models.decoder import DecoderOnlyLM
from xlaserve.models.layers import LayerSpec, Linear, RMSNorm
from xlaserve.models.mamba2 import DepthwiseConv1d, rename_backbone, state_model_fields


@dataclass(frozen=True)
class MambaConfig(TransformerConfig):
    """Mamba's config.json; `intermediate_size` is the mixer's width D (expand * hidden_size)."""

    state_size: int = 16  # N
    conv_kernel: int = 4
    time_step_rank: int = 0
    use_conv_bias: bool = True
    use_bias: bool = False  # in_proj and out_proj
    bc_norms: bool = False  # RMS norms on the time step, B and C (Jamba)

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        rank = hf.get("time_step_rank", "auto")
        return dict(
            **state_model_fields(hf),
            num_heads=1,
            num_kv_heads=1,
            head_dim=hf["hidden_size"],
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            state_size=hf.get("state_size", 16),
            conv_kernel=hf.get("conv_kernel", 4),
            time_step_rank=math.ceil(hf["hidden_size"] / 16) if rank == "auto" else rank,
            use_conv_bias=bool(hf.get("use_conv_bias", True)),
            use_bias=bool(hf.get("use_bias", False)),
        )


class MambaMixer(nnx.Module):
    def __init__(self, cfg: MambaConfig, *, dtype, rngs: nnx.Rngs):
        inner, n, rank = cfg.intermediate_size, cfg.state_size, cfg.time_step_rank
        self.in_proj = Linear(cfg.hidden_size, 2 * inner, use_bias=cfg.use_bias, dtype=dtype, rngs=rngs)
        self.conv1d = DepthwiseConv1d(
            inner, cfg.conv_kernel, use_bias=cfg.use_conv_bias, dtype=dtype, rngs=rngs
        )
        self.x_proj = Linear(inner, rank + 2 * n, dtype=dtype, rngs=rngs)
        self.dt_proj = Linear(rank, inner, use_bias=True, dtype=dtype, rngs=rngs)
        if cfg.bc_norms:
            self.dt_layernorm = RMSNorm(rank, cfg.rms_norm_eps, dtype=dtype)
            self.b_layernorm = RMSNorm(n, cfg.rms_norm_eps, dtype=dtype)
            self.c_layernorm = RMSNorm(n, cfg.rms_norm_eps, dtype=dtype)
        self.A_log = nnx.Param(jnp.zeros((inner, n), dtype))
        self.D = nnx.Param(jnp.ones((inner,), dtype))
        self.out_proj = Linear(inner, cfg.hidden_size, use_bias=cfg.use_bias, dtype=dtype, rngs=rngs)
        self.sizes = (rank, n)
        self.bc_norms = cfg.bc_norms

    def __call__(
        self, x: jax.Array, cache: MambaCache, md: AttentionMetadata, slots: jax.Array | None = None
    ) -> tuple[jax.Array, MambaCache]:  # x [T, D]
        """`slots` [R]: each sequence's row in the cache arrays; None: the block table's first column
        (Mamba's own cache, whose one state group presents the slot as the table)."""
        rank, n = self.sizes
        if slots is None:
            slots = md.block_tables[:, 0]
        xs, z = jnp.split(self.in_proj(x), 2, axis=-1)  # [T, D] each
        conv_in, state_in = entering_states(md, slots, cache.conv[:, 0], cache.ssm)  # state [R, D, 1, N]
        bias = None if self.conv1d.bias is None else self.conv1d.bias[...]
        xs, conv_out = ragged_causal_conv1d(
            xs, self.conv1d.weight[...][:, 0], bias, conv_in, md.query_start_loc
        )
        xs = jax.nn.silu(xs.astype(jnp.float32)).astype(x.dtype)
        t, b, c = jnp.split(self.x_proj(xs), [rank, rank + n], axis=-1)
        if self.bc_norms:
            t, b, c = self.dt_layernorm(t), self.b_layernorm(b), self.c_layernorm(c)
        dt = jax.nn.softplus(self.dt_proj(t, jnp.float32))  # its bias inside: softplus(W t + b)
        y, state_out = ragged_selective_scan(
            xs,
            dt,
            -jnp.exp(self.A_log[...].astype(jnp.float32)),
            b,
            c,
            self.D[...].astype(jnp.float32),
            md.query_start_loc,
            state_in[:, :, 0].astype(jnp.float32),
        )
        y = (y * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)
        cache = MambaCache(
            conv=cache.conv.at[slots, 0].set(conv_out.astype(cache.conv.dtype)),
            ssm=cache.ssm.at[slots].set(state_out[:, :, None].astype(cache.ssm.dtype)),
        )
        return self.out_proj(y), cache


class MambaLayer(nnx.Module):
    """x + mixer(norm(x))."""

    def __init__(self, cfg: MambaConfig, backend: AttentionBackend, *, dtype, rngs: nnx.Rngs):
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mixer = MambaMixer(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, cache: MambaCache, md: AttentionMetadata, spec: LayerSpec):
        h, cache = self.mixer(self.norm(x), cache, md)
        return x + h, cache


# Why Mamba (1) families refuse tensor parallelism (models/interfaces.py `tensor_parallel_unsupported`).
MAMBA_TP_UNSUPPORTED = (
    "its Mamba mixers' channels have no sharding rules yet (x_proj's B, C and dt are shared by every channel)"
)


class MambaForCausalLM(DecoderOnlyLM):
    config_class = MambaConfig
    layer_class = MambaLayer
    tensor_parallel_unsupported = MAMBA_TP_UNSUPPORTED

    @classmethod
    def kv_cache_spec(cls, cfg: MambaConfig) -> StateCacheSpec:
        """A state slot per request: each layer's conv inputs and its [D, 1, N] state."""
        return StateCacheSpec(
            cfg.num_layers, cfg.conv_kernel, cfg.intermediate_size, cfg.intermediate_size, 1, cfg.state_size
        )

    @classmethod
    def prepare_hf_tensors(cls, cfg: MambaConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return rename_backbone(tensors)
