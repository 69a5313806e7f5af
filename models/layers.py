"""Layers shared by the model families: norms, projections, embedding, attention over the paged
cache, gated MLP, and the per-layer spec that the layer scan carries.

What a family changes comes from `TransformerConfig` fields (biases, q/k norm, Gemma's (1 + w)
norm, soft-caps, partial RoPE, activation), so these constructors take only (cfg, backend, dtype,
rngs). What changes from one layer to the next (sliding window, RoPE frequencies) cannot be a
Python branch inside a `lax.scan` body: it arrives as a `LayerSpec`, scanned with the weights.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.kernels import AttentionBackend, AttentionMetadata, KVCache
from xlaserve.kernels.dtype_ops import dequantize, matmul, take_rows
from xlaserve.kernels.invariant import invariant_mean
from xlaserve.kernels.reference import token_positions
from xlaserve.models.config import TransformerConfig
from xlaserve.models.lora import Adaptable
from xlaserve.models.quantization import QuantizedKernel
from xlaserve.models.rope import (
    layer_rope_inv_freqs,
    layer_rope_scales,
    longrope_angles,
    rope_angles,
    rope_cos_sin,
    rotate_halves,
)

# The window of a full-attention layer when some layers slide: wider than any context.
NO_WINDOW = 2**30


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """What differs between stacked layers; each field has a leading layer axis before the scan."""

    index: jax.Array  # [] int32: the layer number (its block offset in the KV cache)
    sliding_window: jax.Array  # [] int32: NO_WINDOW on full-attention layers
    rope_inv_freq: jax.Array  # [rotary_dim // 2] float32
    rope_scale: jax.Array  # [] float32: multiplies cos and sin (YaRN's attention factor; else 1)


def layer_specs(cfg: TransformerConfig) -> LayerSpec:
    """The stacked specs of all layers ([num_layers, ...] numpy arrays, constants of the program)."""
    windows = [NO_WINDOW if w is None else w for w in cfg.layer_sliding_windows]
    return LayerSpec(
        index=np.arange(cfg.num_layers, dtype=np.int32),
        sliding_window=np.asarray(windows, np.int32),
        rope_inv_freq=layer_rope_inv_freqs(cfg).astype(np.float32),
        rope_scale=layer_rope_scales(cfg).astype(np.float32),
    )


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap): squashes x into (-cap, cap); identity when cap is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


_ACTIVATIONS = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}


def activation(name: str):
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"hidden activation {name!r} is not supported: expected one of {sorted(_ACTIVATIONS)}"
        ) from None


class RMSNorm(nnx.Module):
    """Root-mean-square norm, computed in float32 like Hugging Face's.

    offset 0: weight * norm(x) cast to x's dtype first (Llama); offset 1: norm(x) * (1 + weight) in
    float32, then cast (Gemma, whose stored weights are centred on zero).
    """

    def __init__(self, dim: int, eps: float, *, offset: float = 0.0, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.full((dim,), 1.0 - offset, dtype))
        self.eps = eps
        self.offset = offset

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(invariant_mean(x32 * x32, keepdims=True) + self.eps)
        if self.offset:
            return (x32 * (self.offset + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...] * x32.astype(x.dtype)


class Linear(QuantizedKernel, Adaptable, nnx.Module):
    """y = x @ W (+ b) with W stored [in, out]; loaders transpose Hugging Face's [out, in].
    W may be quantized (int8 or float8 with `kernel_scale`: models/quantization.py). With LoRA, the
    step's adapter slots are bound to it (models/lora.py) and their delta is added to y."""

    def __init__(self, din: int, dout: int, *, use_bias: bool = False, dtype=jnp.float32, rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(0.02)
        self.kernel = nnx.Param(init(rngs.params(), (din, dout), dtype))
        self.bias = nnx.Param(jnp.zeros((dout,), dtype)) if use_bias else None

    def __call__(self, x: jax.Array, out_dtype=None) -> jax.Array:
        y = self.project(x, out_dtype)
        return self.with_adapter(y if self.bias is None else y + self.bias[...], x)


class Embedding(QuantizedKernel, nnx.Module):
    """The token embedding `weight` [V, D], also the tied LM head.

    Quantized (models/quantization.py) the table is held as `kernel` [D, V], the LM head's layout,
    with scales per vocabulary entry ([1, V], which are the head's per-output-channel scales) or per
    32 of its D values (a GGUF's Q8_0 table: [D / 32, V]); `weight` is then None. The tied head is
    an ordinary quantized matmul (no transposed copy), and a lookup gathers the columns of its ids
    and dequantizes only those."""

    def __init__(self, vocab_size: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(jax.nn.initializers.normal(0.02)(rngs.params(), (vocab_size, dim), dtype))
        self.dtype = jnp.dtype(dtype)

    def kernel_shape(self) -> tuple[int, ...]:
        return self.weight[...].shape[::-1]

    def use_kernel(self, kernel: nnx.Param) -> None:
        self.weight = None
        self.kernel = kernel

    def __call__(self, ids: jax.Array) -> jax.Array:  # [T] -> [T, D]
        if self.kernel_scale is None:
            return take_rows(self.weight[...], ids)
        # Ids are clamped into the table, as row indexing does (`take_rows`); jnp.take would fill NaN.
        columns = self.decode_kernel(jnp.take(self.kernel[...], ids, axis=-1, mode="clip"))  # [D, T]
        scale, zero = self.scales()
        scale, zero = (None if s is None else jnp.take(s, ids, axis=-1, mode="clip") for s in (scale, zero))
        return dequantize(columns, scale, self.dtype, zero, self.quant_block).T

    def attend(self, x: jax.Array) -> jax.Array:  # [N, D] -> [N, V] float32: the tied LM head
        if self.kernel_scale is None:
            return matmul(x, self.weight[...].T, jnp.float32)
        return self.project(x, jnp.float32)


class Attention(nnx.Module):
    """Grouped-query self-attention whose keys and values live in the paged KV cache.

    From cfg: biases on q/k/v (attention_bias) and on o_proj (attention_out_bias), an RMSNorm over
    each head of q and k before RoPE (qk_norm: Qwen3, Gemma3), the score scale
    (query_pre_attn_scalar), score soft-capping, partial RoPE, an output gate (Qwen3.5), a sink
    logit per head (gpt-oss: the softmax may give weight to no key). Per layer, from `spec`: the RoPE
    frequencies and the sliding window. A family with fused projections overrides `project_qkv`.
    """

    def __init__(self, cfg: TransformerConfig, backend: AttentionBackend, *, dtype, rngs: nnx.Rngs):
        d, hd = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.backend = backend
        self.init_projections(cfg, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(cfg.num_heads * hd, d, use_bias=cfg.attention_out_bias, dtype=dtype, rngs=rngs)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, offset=cfg.norm_offset, dtype=dtype)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, offset=cfg.norm_offset, dtype=dtype)
        self.sinks = nnx.Param(jnp.zeros((cfg.num_heads,), dtype)) if cfg.attention_sinks else None

    def init_projections(self, cfg: TransformerConfig, *, dtype, rngs: nnx.Rngs) -> None:
        d, hd, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        q_width = cfg.num_heads * hd * (2 if cfg.attn_output_gate else 1)  # each head's query, then its gate
        self.q_proj = Linear(d, q_width, use_bias=bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(d, cfg.num_kv_heads * hd, use_bias=bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(d, cfg.num_kv_heads * hd, use_bias=bias, dtype=dtype, rngs=rngs)

    def project_qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """[T, D] -> q [T, num_heads * head_dim], k and v [T, num_kv_heads * head_dim]."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def __call__(
        self,
        x: jax.Array,  # [T, D]
        positions: jax.Array,  # [T]
        kv_cache: KVCache,
        md: AttentionMetadata,  # already offset to this layer's blocks
        spec: LayerSpec,  # this layer's
    ) -> tuple[jax.Array, KVCache]:
        cfg = self.cfg
        num_tokens = x.shape[0]
        q, k, v = self.project_qkv(x)
        gate = None
        if cfg.attn_output_gate:
            q, gate = jnp.split(q.reshape(num_tokens, cfg.num_heads, 2 * cfg.head_dim), 2, axis=-1)
        q = q.reshape(num_tokens, cfg.num_heads, cfg.head_dim)
        k = k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if cfg.rotary_dim:  # none: no position embedding at all (Granite 4.0-H's NoPE attention)
            cos_sin = md.rope  # computed once per step when every layer rotates alike (`with_shared_rope`)
            if cos_sin is None:
                cos_sin = rope_cos_sin(
                    rope_angles_of(cfg, positions, md, spec.rope_inv_freq), spec.rope_scale
                )
            rotated_q, rotated_k = rotate_halves(q, cos_sin), rotate_halves(k, cos_sin)
            if cfg.nope_layers:  # SmolLM3: a layer without RoPE has zero frequencies (models/rope.py)
                is_nope = spec.rope_inv_freq[0] == 0
                rotated_q, rotated_k = jnp.where(is_nope, q, rotated_q), jnp.where(is_nope, k, rotated_k)
            q, k = rotated_q, rotated_k
        k_cache, v_cache = self.backend.write_kv(
            kv_cache.k, kv_cache.v, k, v, md.slot_mapping, positions=positions
        )
        out = self.backend.attention(
            q,
            k_cache,
            v_cache,
            md.kv_lens,
            md.block_tables,
            md.query_start_loc,
            md.num_seqs,
            sm_scale=cfg.attention_scale,
            sliding_window=_sliding_window(cfg, spec),
            soft_cap=cfg.attn_logit_softcap,
            **({} if self.sinks is None else {"sinks": self.sinks[...].astype(jnp.float32)}),
            **({} if md.attend_ahead is None else {"attend_ahead": md.attend_ahead}),
        )
        out = out.reshape(num_tokens, -1)
        if gate is not None:
            out = out * jax.nn.sigmoid(gate.reshape(num_tokens, -1))
        return self.o_proj(out), KVCache(k_cache, v_cache)


def rope_angles_of(cfg: TransformerConfig, positions, md: AttentionMetadata, inv_freq) -> jax.Array:
    """[T, rotary_dim // 2]: a layer's frequencies `inv_freq`, or ones that depend on the position
    (dynamic NTK) or on the sequence's length (LongRoPE)."""
    scaling = cfg.rope_scaling_dict
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "dynamic":
        return rope_angles(positions, cfg.rotary_dim, cfg.rope_theta, scaling, cfg.max_position_embeddings)
    if rope_type == "longrope":
        seq, _, _ = token_positions(positions.shape[0], md.kv_lens, md.query_start_loc, md.num_seqs)
        return longrope_angles(positions, md.kv_lens[seq], cfg.rotary_dim, cfg.rope_theta, scaling)
    return positions.astype(jnp.float32)[:, None] * inv_freq[None, :]


def with_shared_rope(cfg: TransformerConfig, positions, md: AttentionMetadata) -> AttentionMetadata:
    """`md` carrying cos and sin for all layers, computed once, when every layer has the same rotary
    frequencies and scale (all but Gemma 3's two kinds). Computed inside a layer, XLA's CPU backend
    fused cos and sin into the rotation and evaluated them once per element of q and of k (heads x
    head_dim times each angle): ~7 ms of a batch-64 SmolLM2 step (engine/PERFORMANCE.md)."""
    if md.rope is not None:  # the model's own (Qwen2.5-VL's multimodal positions)
        return md
    inv_freqs, scales = layer_rope_inv_freqs(cfg), layer_rope_scales(cfg)
    rotated = np.ones(len(inv_freqs), bool)
    rotated[list(cfg.nope_layers)] = False  # they rotate by nothing whatever md carries (Attention)
    inv_freqs, scales = inv_freqs[rotated], scales[rotated]
    if cfg.rotary_dim == 0 or not rotated.any():
        return md
    if not (np.all(inv_freqs == inv_freqs[0]) and np.all(scales == scales[0])):
        return md
    inv_freq = jnp.asarray(inv_freqs[0], jnp.float32)
    angles = rope_angles_of(cfg, positions, md, inv_freq)
    return dataclasses.replace(md, rope=rope_cos_sin(angles, float(scales[0])))


def _sliding_window(cfg: TransformerConfig, spec: LayerSpec) -> int | jax.Array | None:
    """None when no layer slides, a static int when all slide alike (Mistral), else this layer's,
    traced (Gemma: alternating), which the attention op reads as a scalar array."""
    windows = set(cfg.layer_sliding_windows)
    if windows == {None}:
        return None
    if len(windows) == 1:
        return windows.pop()
    return spec.sliding_window


class GatedMLP(nnx.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with silu, GeGLU with Gemma's tanh GELU."""

    def __init__(self, cfg: TransformerConfig, *, dtype, rngs: nnx.Rngs):
        activation(cfg.hidden_act)  # an unknown one fails here, at construction
        self.hidden_act = cfg.hidden_act
        self.init_projections(cfg, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(
            cfg.intermediate_size, cfg.hidden_size, use_bias=cfg.mlp_bias, dtype=dtype, rngs=rngs
        )

    def init_projections(self, cfg: TransformerConfig, *, dtype, rngs: nnx.Rngs) -> None:
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(d, f, use_bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(d, f, use_bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)

    def project_gate_up(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return self.gate_proj(x), self.up_proj(x)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = self.project_gate_up(x)
        # In float32, rounded once: in 16 bits XLA's CPU backend rounds after each op of the activation
        # (a convert pair per op; torch computes its fused silu in float32 too).
        h = (activation(self.hidden_act)(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(x.dtype)
        return self.down_proj(h)
