"""EAGLE-3's draft network (a released `LlamaForCausalLMEagle3` checkpoint, vLLM's llama_eagle3), for
speculative decoding with `{"method": "eagle3", "model": PATH}` (worker/eagle3.py).

At position i it reads the token at i + 1 and a hidden state for position i: over the step's flat batch,
the target's aux hidden states (the residual stream entering three of its layers, [3 * H_target]) put
through `fc`; past the first draft, its own pre-norm output at the position before.

    e = input_layernorm(embed(token_{i+1}));  r = hidden_i;  n = hidden_norm(r)
    h = r + self_attn([e | n])                       q, k and v read 2H; its own K/V
    x = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(x)) over the draft vocabulary;  x is the next draft's hidden state

The draft vocabulary maps into the target's by `d2t` (target id = draft id + d2t[draft id]); target
ids it cannot name get -inf. Its embedding is its own where the checkpoint has one (`embed_tokens`),
else the target's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.kernels import AttentionBackend, AttentionMetadata, KVCache
from xlaserve.models.config import TransformerConfig
from xlaserve.models.draft_layer import OneLayerDrafter
from xlaserve.models.layers import Attention, Embedding, GatedMLP, Linear, RMSNorm

# The target's layers whose input the drafter reads: config.json's ids, else vLLM's default.
AUX_LAYERS_KEY = "eagle_aux_hidden_state_layer_ids"


def aux_layer_ids(hf_config: dict, num_target_layers: int) -> tuple[int, ...]:
    """The target layers (ascending: vLLM gathers them in layer order) whose input the drafter reads:
    config.json's `eagle_aux_hidden_state_layer_ids` (top level, or in `eagle_config`), else vLLM's
    (2, L // 2, L - 3)."""
    ids = hf_config.get(AUX_LAYERS_KEY) or (hf_config.get("eagle_config") or {}).get(AUX_LAYERS_KEY)
    if not ids:
        ids = (2, num_target_layers // 2, num_target_layers - 3)
    return tuple(sorted(int(i) for i in ids))


class _WideAttention(Attention):
    """Llama's attention whose q, k and v read [embedding | hidden state] (2H wide)."""

    def init_projections(self, cfg: TransformerConfig, *, dtype, rngs: nnx.Rngs) -> None:
        d, hd, bias = 2 * cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.q_proj = Linear(d, cfg.num_heads * hd, use_bias=bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(d, cfg.num_kv_heads * hd, use_bias=bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(d, cfg.num_kv_heads * hd, use_bias=bias, dtype=dtype, rngs=rngs)


class Eagle3Layer(nnx.Module):
    """The checkpoint's `midlayer`: a Llama layer over the two normed halves, its residual the hidden
    state as it came in, or normed (`norm_before_residual`: the speculators library's checkpoints)."""

    def __init__(
        self,
        cfg: TransformerConfig,
        backend: AttentionBackend,
        *,
        norm_before_residual: bool = False,
        dtype,
        rngs: nnx.Rngs,
    ):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(d, eps, dtype=dtype)
        self.hidden_norm = RMSNorm(d, eps, dtype=dtype)
        self.self_attn = _WideAttention(cfg, backend, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(d, eps, dtype=dtype)
        self.mlp = GatedMLP(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, embeds, hidden, positions, kv_cache: KVCache, md: AttentionMetadata, spec):
        normed = self.hidden_norm(hidden)
        x = jnp.concatenate([self.input_layernorm(embeds), normed], axis=-1)
        h, kv_cache = self.self_attn(x, positions, kv_cache, md, spec)
        h = (normed if self.norm_before_residual else hidden) + h
        return h + self.mlp(self.post_attention_layernorm(h)), kv_cache


class Eagle3Network(OneLayerDrafter):
    """The EAGLE-3 network (module doc); `cfg`: the draft's config (one layer), `target_hidden_size`
    and `num_aux` size `fc`; `own_embedding`: the checkpoint has `embed_tokens`."""

    def __init__(
        self,
        cfg: TransformerConfig,
        backend: AttentionBackend,
        *,
        target_hidden_size: int,
        num_aux: int,
        draft_vocab_size: int,
        own_embedding: bool,
        norm_before_residual: bool = False,
        padded_vocab_size: int,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        d = cfg.hidden_size
        self.cfg = cfg
        self.padded_vocab_size = padded_vocab_size  # the width of the target's logits
        self.fc = Linear(num_aux * target_hidden_size, d, dtype=dtype, rngs=rngs)
        self.embed_tokens = Embedding(cfg.vocab_size, d, dtype=dtype, rngs=rngs) if own_embedding else None
        self.midlayer = Eagle3Layer(
            cfg, backend, norm_before_residual=norm_before_residual, dtype=dtype, rngs=rngs
        )
        self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = Linear(d, draft_vocab_size, dtype=dtype, rngs=rngs)

    @classmethod
    def prepare_hf_tensors(cls, cfg, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The released names (`fc.weight`, `midlayer.*`, `norm.weight`, `embed_tokens.weight`) under the
        loader's `model.` prefix; `lm_head.weight` as it is. (`d2t` and `t2d` are read by the drafter.)"""
        return {n if n.startswith(("lm_head.", "model.")) else f"model.{n}": t for n, t in tensors.items()}

    # -- the drafting interface worker/mtp.py's step calls (models/mtp.py's MultiTokenPredictor too) --

    def embed(self, target, ids: jax.Array) -> jax.Array:
        return target.embed(ids) if self.embed_tokens is None else self.embed_tokens(ids)

    def combine(self, aux: jax.Array) -> jax.Array:
        """The target's aux hidden states [T, 3 * H_target] -> the layer's hidden input [T, H]."""
        return self.fc(aux)

    def __call__(
        self, embeds, hidden, positions, kv_cache: KVCache, md: AttentionMetadata
    ) -> tuple[jax.Array, jax.Array, KVCache]:  # (final-norm output, pre-norm output: the next hidden)
        md, spec = self.one_layer_inputs(positions, kv_cache, md, 0)
        x, kv_cache = self.midlayer(embeds, hidden, positions, kv_cache, md, spec)
        return self.norm(x), x, kv_cache

    def draft_logits(self, target, h: jax.Array, head_dv, draft_to_target: jax.Array) -> jax.Array:
        """[N, H] -> [N, V] float32 over the target's (padded) ids (`draft_to_target` [draft_vocab]:
        each draft id's target id, past the target's ids for a padding draft id: dropped); ids the draft
        vocabulary lacks at -inf."""
        logits = self.lm_head(h, out_dtype=jnp.float32)
        out = jnp.full((h.shape[0], self.padded_vocab_size), -jnp.inf, jnp.float32)
        return out.at[:, draft_to_target].set(logits, mode="drop")
