"""Mamba2 (state-space duality): every layer a gated SSM mixer over a per-request state, no attention.

A layer is x + mixer(norm(x)); the mixer projects x to a gate z, the conv input xBC and a time step
per head, runs a causal depthwise conv (kernel K) over xBC, splits it into x [H, P], B and C [G, N],
and scans h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T, y_t = C_t . h_t + D x_t (kernels/ssd.py);
then y is normed with the gate (RMS over each of G groups of channels) and projected back.

Tensor parallelism splits the mixer by head. At load, in_proj's outputs and the conv's channels are
regrouped per group of heads (`group_mamba2_tensors`: each group's z, x, B, C, dt side by side; the
conv's x, B, C), so a contiguous split over the ranks gives each rank whole groups. Where there are
more ranks than groups (Mamba2 and Granite 4.0-H ship one), each group's B and C are copied
(`group_copies`, as KV heads are repeated) into tensor_parallel_size groups of fewer heads each:
the same SSM, since a head reads its group's B and C either way, and every rank holds the B and C its
heads read. The gated norm keeps the checkpoint's groups (a sum across ranks when a group spans them).

The cache is `MambaCache`: per layer and state slot, the last K - 1 conv inputs and the SSM state
[H, P, N]. A request's slot is its one block id (core/kv_cache_spec.py `StateSpec`), read from the
first column of its block table; the step reads each sequence's state, advances it over the
sequence's new tokens, and writes it back in place. A sequence whose first new token is at
position 0 (a new request, or one recomputed after preemption) enters with zero state.

Hugging Face names the backbone `backbone` (embeddings, layers, norm_f); `prepare_hf_tensors`
renames it to the shared decoder's `model` (embed_tokens, layers, norm), whose scan runs the layers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.kernels import AttentionBackend, AttentionMetadata
from xlaserve.kernels.ssd import (
    MambaCache,
    StateCacheSpec,
    entering_states,
    ragged_causal_conv1d,
    ragged_ssd,
)
from xlaserve.models.config import TransformerConfig
from xlaserve.models.decoder import DecoderOnlyLM
from xlaserve.models.layers import LayerSpec, Linear, RMSNorm

GATE_NORMS = ("after_gate", "before_gate", "none")
# Chunks of the SSD scan: the [chunks, Q, Q, H] intra-chunk tensor grows with Q squared, and the
# result is exact for any Q (only the float rounding differs), so long configured chunks are capped.
MAX_CHUNK_SIZE = 64


@dataclass(frozen=True)
class Mamba2Config(TransformerConfig):
    """Mamba2's config.json; `num_heads` and `head_dim` are the SSM's (H, P), `intermediate_size` its
    inner width (expand * hidden_size = H * P). No RoPE (partial_rotary_factor 0)."""

    state_size: int = 128  # N
    n_groups: int = 1  # G: B and C are shared by H / G heads each
    # Each group's B and C copied this many times under tensor parallelism wider than n_groups
    # (`for_tensor_parallel`): the SSM then runs on n_groups * group_copies groups (`ssm_groups`).
    group_copies: int = 1
    conv_kernel: int = 4  # K
    chunk_size: int = 256
    use_conv_bias: bool = True
    use_bias: bool = False  # in_proj and out_proj
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    # The output's gate: RMS-normed after the gate (Mamba2's), normed before it, or no norm at all
    # (Falcon-H1's `mamba_rms_norm` false: y * silu(z), no norm weight in the checkpoint).
    gate_norm: str = "after_gate"

    def __post_init__(self):
        super().__post_init__()
        if self.intermediate_size != self.num_heads * self.head_dim:
            raise ValueError(
                f"num_heads * head_dim ({self.num_heads * self.head_dim}) must equal expand * hidden_size "
                f"({self.intermediate_size})"
            )
        if self.num_heads % self.ssm_groups:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of n_groups ({self.n_groups}) x the "
                f"copies of each group ({self.group_copies})"
            )
        if self.gate_norm not in GATE_NORMS:
            raise ValueError(f"gate_norm must be one of {GATE_NORMS}, got {self.gate_norm!r}")

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        limit = hf.get("time_step_limit") or (0.0, float("inf"))
        return dict(
            **state_model_fields(hf),
            num_heads=hf["num_heads"],
            num_kv_heads=hf["num_heads"],
            head_dim=hf["head_dim"],
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            state_size=hf.get("state_size", 128),
            n_groups=hf.get("n_groups", 1),
            conv_kernel=hf.get("conv_kernel", 4),
            chunk_size=hf.get("chunk_size", 256),
            use_conv_bias=bool(hf.get("use_conv_bias", True)),
            use_bias=bool(hf.get("use_bias", False)),
            time_step_limit=(_read_float(limit[0]), _read_float(limit[1])),
        )

    @property
    def ssm_groups(self) -> int:
        """Groups of heads the SSM runs on: the checkpoint's, times their copies."""
        return self.n_groups * self.group_copies

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: x, B and C (of every copy)."""
        return self.intermediate_size + 2 * self.ssm_groups * self.state_size

    def for_tensor_parallel(self, tensor_parallel_size: int) -> Mamba2Config:
        return self.replace(group_copies=group_copies(self.n_groups, tensor_parallel_size))

    def checkpoint_rows(self, name: str, rows: int, checkpoint_config: Mamba2Config) -> int:
        # in_proj's outputs and the conv's channels hold every copy of B and C (`group_mamba2_tensors`).
        if _MAMBA2_GROUPED.search(name) is None:
            return rows
        return rows - (self.conv_dim - checkpoint_config.conv_dim)


def state_model_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The TransformerConfig fields Mamba's and Mamba2's config.json spell alike: no attention, no RoPE."""
    eos = hf.get("eos_token_id")
    return dict(
        architecture=(hf.get("architectures") or [""])[0],
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=int(hf.get("expand", 2) * hf["hidden_size"]),
        num_layers=hf["num_hidden_layers"],
        rms_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        rope_theta=10000.0,
        rope_scaling=None,
        # A state holds any length: the context is bounded by max_model_len alone.
        max_position_embeddings=hf.get("max_position_embeddings") or 2**20,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,)),
        hidden_act=hf.get("hidden_act") or "silu",
        partial_rotary_factor=0.0,
    )


def group_copies(n_groups: int, tensor_parallel_size: int) -> int:
    """Copies of each B/C group so that every rank holds whole groups: tp / n_groups when tp is a
    larger multiple of n_groups, else 1 (n_groups a multiple of tp splits as it is; other pairs are
    refused by the placement, sharding/mesh.py)."""
    if tensor_parallel_size > n_groups and tensor_parallel_size % n_groups == 0:
        return tensor_parallel_size // n_groups
    return 1


_MAMBA2_GROUPED = re.compile(r"\.(mixer|mamba)\.(in_proj|conv1d)\.(weight|bias)$")


def group_mamba2_tensors(cfg: Mamba2Config, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every Mamba2 mixer's in_proj rows ([z | x | B | C | dt], Hugging Face's order) and conv channels
    ([x | B | C]) regrouped per SSM group: [z_g | x_g | B_g | C_g | dt_g] and [x_g | B_g | C_g] for each
    of the `ssm_groups` groups, B and C repeated `group_copies` times (see the module docstring)."""
    inner, n, g = cfg.intermediate_size, cfg.state_size, cfg.n_groups
    widths = {"in_proj": (inner, inner, g * n, g * n), "conv1d": (inner, g * n)}
    kinds = {
        "in_proj": ("heads", "heads", "groups", "groups", "heads"),
        "conv1d": ("heads", "groups", "groups"),
    }

    def regroup(module: str, w: np.ndarray) -> np.ndarray:
        parts = np.split(w, np.cumsum(widths[module]))
        per_group = [
            np.repeat(part.reshape(g, -1, *w.shape[1:]), cfg.group_copies, axis=0)
            if kind == "groups"
            else part.reshape(cfg.ssm_groups, -1, *w.shape[1:])
            for part, kind in zip(parts, kinds[module], strict=True)
        ]
        return np.concatenate(per_group, axis=1).reshape(-1, *w.shape[1:])

    out = {}
    for name, tensor in tensors.items():
        m = _MAMBA2_GROUPED.search(name)
        out[name] = tensor if m is None else regroup(m[2], np.asarray(tensor))
    return out


def _read_float(value) -> float:
    """A float of config.json, where transformers writes infinity as {"__float__": "Infinity"}."""
    if isinstance(value, dict):
        value = value.get("__float__")
    return float("inf") if value is None else float(value)


class DepthwiseConv1d(nnx.Module):
    """Hugging Face's grouped Conv1d parameters as they are stored: weight [C, 1, K], bias [C]."""

    def __init__(self, channels: int, kernel: int, *, use_bias: bool, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(jax.nn.initializers.normal(0.1)(rngs.params(), (channels, 1, kernel), dtype))
        self.bias = nnx.Param(jnp.zeros((channels,), dtype)) if use_bias else None


class GatedRMSNorm(nnx.Module):
    """y * silu(z), RMS-normed over each group of channels in float32, then scaled (HF's
    MambaRMSNormGated with norm_before_gate=False); with `before_gate`, y normed and scaled, then
    times silu(z) (Falcon-H1's norm_before_gate=True)."""

    def __init__(self, dim: int, group_size: int, eps: float, *, dtype, before_gate: bool = False):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.group_size = group_size
        self.eps = eps
        self.before_gate = before_gate

    def __call__(self, y: jax.Array, z: jax.Array) -> jax.Array:  # [T, D] each -> [T, D] in z's dtype
        gate = jax.nn.silu(z.astype(jnp.float32))
        h = y.astype(jnp.float32) if self.before_gate else y.astype(jnp.float32) * gate
        groups = h.reshape(h.shape[0], -1, self.group_size)
        groups = groups * jax.lax.rsqrt(jnp.mean(groups * groups, axis=-1, keepdims=True) + self.eps)
        if self.before_gate:
            return (self.weight[...].astype(jnp.float32) * groups.reshape(h.shape) * gate).astype(z.dtype)
        return self.weight[...] * groups.reshape(h.shape).astype(z.dtype)


class SiluGate(nnx.Module):
    """y * silu(z) with no norm (Falcon-H1 without `mamba_rms_norm`)."""

    def __call__(self, y: jax.Array, z: jax.Array) -> jax.Array:
        return (y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(z.dtype)


class Mamba2Mixer(nnx.Module):
    def __init__(self, cfg: Mamba2Config, backend: AttentionBackend, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.chunk_terms = backend.ssd_chunk_terms  # the reference, or the Pallas kernel (kernels/backend.py)
        inner, heads = cfg.intermediate_size, cfg.num_heads
        self.in_proj = Linear(
            cfg.hidden_size, inner + cfg.conv_dim + heads, use_bias=cfg.use_bias, dtype=dtype, rngs=rngs
        )
        self.conv1d = DepthwiseConv1d(
            cfg.conv_dim, cfg.conv_kernel, use_bias=cfg.use_conv_bias, dtype=dtype, rngs=rngs
        )
        self.dt_bias = nnx.Param(jnp.zeros((heads,), dtype))
        self.A_log = nnx.Param(jnp.zeros((heads,), dtype))
        self.D = nnx.Param(jnp.ones((heads,), dtype))
        if cfg.gate_norm == "none":
            self.norm = SiluGate()
        else:
            before = cfg.gate_norm == "before_gate"
            self.norm = GatedRMSNorm(
                inner, inner // cfg.n_groups, cfg.rms_norm_eps, dtype=dtype, before_gate=before
            )
        self.out_proj = Linear(inner, cfg.hidden_size, use_bias=cfg.use_bias, dtype=dtype, rngs=rngs)

    def project_in(self, x: jax.Array) -> jax.Array:  # [T, D] -> [T, inner + conv_dim + heads]
        """Per SSM group its gate z, conv input xBC and time steps (`group_mamba2_tensors`; a family
        may scale them)."""
        return self.in_proj(x)

    def __call__(
        self, x: jax.Array, cache: MambaCache, md: AttentionMetadata, slots: jax.Array | None = None
    ) -> tuple[jax.Array, MambaCache]:  # x [T, D]
        """`slots` [R]: each sequence's row in the cache arrays; None: the block table's first column
        (Mamba2's own cache, whose one state group presents the slot as the table)."""
        cfg = self.cfg
        num_tokens = x.shape[0]
        inner, heads, groups, n = cfg.intermediate_size, cfg.num_heads, cfg.ssm_groups, cfg.state_size
        group_inner = inner // groups  # a group's heads' channels
        per_group = self.project_in(x).reshape(num_tokens, groups, -1)  # [T, G, z x B C dt]
        gate, xbc, dt = jnp.split(per_group, [group_inner, 2 * group_inner + 2 * n], axis=-1)
        gate, dt = gate.reshape(num_tokens, inner), dt.reshape(num_tokens, heads)
        xbc = xbc.reshape(num_tokens, cfg.conv_dim)  # the conv's channels, per group x B C
        qsl = md.query_start_loc
        if slots is None:
            slots = md.block_tables[:, 0]  # [R]: each sequence's state slot among this layer's rows
        conv_in, ssm_in = entering_states(
            md, slots, cache.conv[:, 0], cache.ssm
        )  # [R, K-1, Cd], [R, H, P, N]
        bias = None if self.conv1d.bias is None else self.conv1d.bias[...]
        xbc, conv_out = ragged_causal_conv1d(xbc, self.conv1d.weight[...][:, 0], bias, conv_in, qsl)
        xbc = jax.nn.silu(xbc.astype(jnp.float32)).astype(x.dtype).reshape(num_tokens, groups, -1)
        xs, b, c = jnp.split(xbc, [group_inner, group_inner + n], axis=-1)  # [T, G, ..] each
        dt = jax.nn.softplus(dt.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        dt = jnp.clip(dt, *cfg.time_step_limit)
        y, ssm_out = ragged_ssd(
            xs.reshape(num_tokens, heads, cfg.head_dim),
            dt,
            -jnp.exp(self.A_log[...].astype(jnp.float32)),
            b,
            c,
            self.D[...].astype(jnp.float32),
            qsl,
            ssm_in.astype(jnp.float32),
            chunk_size=min(cfg.chunk_size, MAX_CHUNK_SIZE, num_tokens),
            chunk_terms=self.chunk_terms,
        )
        y = self.norm(y.reshape(num_tokens, inner), gate)
        cache = MambaCache(
            conv=cache.conv.at[slots, 0].set(conv_out.astype(cache.conv.dtype)),
            ssm=cache.ssm.at[slots].set(ssm_out.astype(cache.ssm.dtype)),
        )
        return self.out_proj(y.astype(x.dtype)), cache


class Mamba2Layer(nnx.Module):
    """x + mixer(norm(x))."""

    def __init__(self, cfg: Mamba2Config, backend: AttentionBackend, *, dtype, rngs: nnx.Rngs):
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mixer = Mamba2Mixer(cfg, backend, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, cache: MambaCache, md: AttentionMetadata, spec: LayerSpec):
        h, cache = self.mixer(self.norm(x), cache, md)
        return x + h, cache


class Mamba2ForCausalLM(DecoderOnlyLM):
    config_class = Mamba2Config
    layer_class = Mamba2Layer

    @classmethod
    def kv_cache_spec(cls, cfg: Mamba2Config) -> StateCacheSpec:
        """A state slot per request: the conv inputs and the SSM state of every layer."""
        return StateCacheSpec(
            cfg.num_layers, cfg.conv_kernel, cfg.conv_dim, cfg.num_heads, cfg.head_dim, cfg.state_size
        )

    @classmethod
    def prepare_hf_tensors(cls, cfg: Mamba2Config, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The backbone renamed (`rename_backbone`); the mixers regrouped per SSM group."""
        return group_mamba2_tensors(cfg, rename_backbone(tensors))


def rename_backbone(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`backbone.*` -> the shared decoder's `model.*` names (Mamba and Mamba2 checkpoints)."""
    renamed = {}
    for name, tensor in tensors.items():
        name = name.replace("backbone.embeddings.", "model.embed_tokens.")
        name = name.replace("backbone.norm_f.", "model.norm.").replace("backbone.", "model.")
        renamed[name] = tensor
    return renamed
