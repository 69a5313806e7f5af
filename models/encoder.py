"""The encoder-only backbone (BERT's post-norm layers) behind a pooling engine: bidirectional
attention over each whole prompt, no KV cache kept.

An encoder runs through the same runner and step as a decoder (one compiled forward per token bucket;
the pooling hook reads its hidden states), with three differences the engine knows of through the
pooler (worker/pooler.py): the scheduler computes each prompt whole in one step (a token attends to
keys after it, so a chunk would need what is not computed yet), no prefix is cached, and the paged cache
is a placeholder of one tiny array whose blocks only count the tokens in flight (`kv_cache_spec`).

Attention is a plain online softmax per token over fixed chunks of `KEY_CHUNK` keys of its own sequence,
counted from the sequence's first token, each chunk's sums in a fixed tree (kernels/invariant.py): what a
token computes is set by its sequence alone, never by the bucket or its neighbours in the step, so a
prompt pools the same bits alone or in a batch. Chunks past a sequence's end change nothing (exp(-inf)
is 0, the running max stays), so the loop runs to the step's longest sequence.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.kernels import AttentionBackend, AttentionMetadata, KVCacheSpec
from xlaserve.kernels.dtype_ops import matmul, scan, take_rows
from xlaserve.kernels.invariant import invariant_mean, invariant_sum
from xlaserve.models.config import TransformerConfig
from xlaserve.models.layers import Embedding, Linear, activation

KEY_CHUNK = 16  # keys per online-softmax step: fixed, so a token's sums never depend on the bucket
# The placeholder cache's blocks count tokens in flight (the scheduler admits by free blocks): enough
# for every step the scheduler can fill, since each encoder request finishes in the step it runs in.
TOKENS_IN_FLIGHT = 1 << 16


class LayerNorm(nnx.Module):
    """(x - mean) / sqrt(var + eps) * weight (+ bias), in float32 with order-fixed sums."""

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32, use_bias: bool = True):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype)) if use_bias else None
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:  # [T, D]
        x32 = x.astype(jnp.float32)
        centred = x32 - invariant_mean(x32, keepdims=True)
        var = invariant_mean(centred * centred, keepdims=True)
        y = centred * jax.lax.rsqrt(var + self.eps) * self.weight[...].astype(jnp.float32)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


class Table(nnx.Module):
    """A learned lookup table `weight` [N, D] (position or token-type embeddings)."""

    def __init__(self, num: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(jax.nn.initializers.normal(0.02)(rngs.params(), (num, dim), dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:  # [T] -> [T, D]
        return take_rows(self.weight[...], ids)


def bidirectional_attention(
    q: jax.Array,  # [T, H, Dh]
    k: jax.Array,  # [T, H, Dh]
    v: jax.Array,  # [T, H, Dh]
    seq_start: jax.Array,  # [T] int32: the flat index of each token's sequence's first token
    seq_len: jax.Array,  # [T] int32: that sequence's length (0 for padding tokens)
    scale: float,
    half_window: jax.Array | int | None = None,
) -> jax.Array:  # [T, H, Dh] in q's dtype
    """Each token attends to every token of its own sequence (module docstring: the chunk order), or
    with `half_window` to those at most that many positions away on either side (ModernBERT's local
    layers). Chunks wholly outside a token's window add nothing, as chunks past its sequence's end."""
    num_tokens = q.shape[0]
    q32 = q.astype(jnp.float32)
    offsets = jnp.arange(KEY_CHUNK, dtype=jnp.int32)
    own = jnp.arange(num_tokens, dtype=jnp.int32) - seq_start  # each token's position in its sequence

    def chunk(c, carry):
        m, l, acc = carry  # [T, H], [T, H], [T, H, Dh]
        rel = c * KEY_CHUNK + offsets  # [C] positions in the sequence
        visible = rel[None, :] < seq_len[:, None]  # [T, C]
        if half_window is not None:
            visible &= jnp.abs(rel[None, :] - own[:, None]) <= half_window
        idx = jnp.where(visible, seq_start[:, None] + rel[None, :], 0)
        k_c = take_rows(k, idx).astype(jnp.float32)  # [T, C, H, Dh]
        v_c = take_rows(v, idx).astype(jnp.float32)
        s = invariant_sum(q32[:, None] * k_c, axis=-1) * scale  # [T, C, H]
        s = jnp.where(visible[..., None], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.exp(m - m_safe)  # 1 where nothing new is visible; 0 on the first chunk
        p = jnp.exp(s - m_safe[:, None])  # [T, C, H]
        l = l * alpha + invariant_sum(p, axis=1)
        acc = acc * alpha[..., None] + invariant_sum(p[..., None] * v_c, axis=1)
        return m_new, l, acc

    h, dh = q.shape[1], q.shape[2]
    init = (
        jnp.full((num_tokens, h), -jnp.inf, jnp.float32),
        jnp.zeros((num_tokens, h), jnp.float32),
        jnp.zeros((num_tokens, h, dh), jnp.float32),
    )
    num_chunks = (jnp.max(seq_len) + KEY_CHUNK - 1) // KEY_CHUNK
    _, l, acc = jax.lax.fori_loop(0, num_chunks, chunk, init)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return out.astype(q.dtype)


def sequence_bounds(md: AttentionMetadata, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """Per token of the step: the flat index of its sequence's first token, and that sequence's length
    (0 for the bucket's padding tokens): what `bidirectional_attention` bounds each token's keys by."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    qsl = md.query_start_loc
    seq = jnp.minimum(jnp.searchsorted(qsl[1:], t, side="right"), qsl.shape[0] - 2)
    seq_start = qsl[seq]
    return seq_start, jnp.where(t < qsl[md.num_seqs], qsl[seq + 1] - seq_start, 0)


class EncoderLayer(nnx.Module):
    """BERT's post-norm layer: x = LN(x + attn(x)); x = LN(x + down(act(up(x))))."""

    def __init__(self, cfg: TransformerConfig, *, dtype, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.q_proj = Linear(d, d, use_bias=True, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(d, d, use_bias=True, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(d, d, use_bias=True, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(d, d, use_bias=True, dtype=dtype, rngs=rngs)
        self.attn_norm = LayerNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.up_proj = Linear(d, f, use_bias=True, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(f, d, use_bias=True, dtype=dtype, rngs=rngs)
        self.mlp_norm = LayerNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.act = activation(cfg.hidden_act)

    def __call__(self, x, seq_start, seq_len):  # x [T, D]
        t = x.shape[0]
        heads = (t, self.num_heads, self.head_dim)
        q, k, v = (p(x).reshape(heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        attn = bidirectional_attention(q, k, v, seq_start, seq_len, self.scale).reshape(t, -1)
        x = self.attn_norm(x + self.o_proj(attn))
        return self.mlp_norm(x + self.down_proj(self.act(self.up_proj(x))))


class EncoderOnlyLM(nnx.Module):
    """Embeddings (word + position + token type, then a norm), post-norm layers under one scan.

    Implements the `CausalLM` protocol (models/interfaces.py) so that the loader and the runner take it
    as they take a decoder; `compute_logits` is the tied word table (the pooling runner's sampler,
    whose ids nobody reads). A family maps its checkpoint's names onto ours in `prepare_hf_tensors`
    and its position ids in `position_ids`."""

    config_class: ClassVar[type[TransformerConfig]] = TransformerConfig
    is_encoder_only: ClassVar[bool] = True
    default_pooling_type: ClassVar[str] = "CLS"

    def __init__(self, cfg, backend: AttentionBackend, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        d = cfg.hidden_size
        self.embed_tokens = Embedding(cfg.vocab_size, d, dtype=dtype, rngs=rngs)
        self.embed_positions = Table(cfg.num_position_embeddings, d, dtype=dtype, rngs=rngs)
        self.embed_types = Table(max(cfg.type_vocab_size, 1), d, dtype=dtype, rngs=rngs)
        self.embed_norm = LayerNorm(d, cfg.rms_norm_eps, dtype=dtype)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs: nnx.Rngs) -> nnx.Module:
            return EncoderLayer(cfg, dtype=dtype, rngs=rngs)

        self.layers = make_layers(rngs)

    @classmethod
    def kv_cache_spec(cls, cfg) -> KVCacheSpec:
        """A placeholder: one array of one value per token, never read (module docstring)."""
        return KVCacheSpec(1, 1, 1, fixed_num_tokens=TOKENS_IN_FLIGHT)

    @classmethod
    def layer_stacks(cls, cfg) -> dict[str, range]:
        return {"layers": range(cfg.num_layers)}

    @classmethod
    def prepare_hf_tensors(cls, cfg, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return tensors

    def position_ids(self, input_ids, positions, seq_start):  # [T] each -> [T]
        return positions

    def __call__(self, input_ids, positions, kv_cache, md: AttentionMetadata, lora=None):
        """-> (hidden [T, D] after the last layer, kv_cache untouched). Every sequence of the step is
        a whole prompt (the scheduler's promise): `positions` count from 0 within each."""
        if lora is not None:
            raise ValueError("LoRA adapters are not supported on encoder-only models")
        seq_start, seq_len = sequence_bounds(md, input_ids.shape[0])
        x = self.embed_tokens(input_ids)
        x = x + self.embed_positions(self.position_ids(input_ids, positions, seq_start))
        x = x + self.embed_types(self.token_type_ids(input_ids, seq_start))
        x = self.embed_norm(x)
        layer_def, layer_state = nnx.split(self.layers)

        def body(x, state):
            return nnx.merge(layer_def, state)(x, seq_start, seq_len), None

        x, _ = scan(body, x, layer_state, words_of=x.dtype)
        return x, kv_cache

    def token_type_ids(self, input_ids, seq_start):  # [T] -> [T]
        """0 up to a sequence's first separator, 1 after it: the second text of a cross-encoder's pair
        (`[CLS] a [SEP] b [SEP]`), which the token ids alone tell apart."""
        sep = self.cfg.sep_token_id
        if sep is None or self.cfg.type_vocab_size < 2:
            return jnp.zeros_like(input_ids)
        is_sep = (input_ids == sep).astype(jnp.int32)
        seps_before = jnp.cumsum(is_sep) - is_sep  # separators strictly before each token, flat
        first_of_seq = seps_before[seq_start]
        return (seps_before - first_of_seq > 0).astype(jnp.int32)

    def compute_logits(self, hidden: jax.Array, head_dv: jax.Array | None = None) -> jax.Array:
        if head_dv is not None:
            return matmul(hidden, head_dv, jnp.float32)
        return self.embed_tokens.attend(hidden)
