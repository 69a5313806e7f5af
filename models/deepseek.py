"""DeepSeek V2 and V3: Multi-head Latent Attention over a paged latent cache, and DeepSeekMoE.

MLA compresses each token's keys and values into one latent `c` (kv_lora_rank) plus a rotated key
part shared by all heads (qk_rope_head_dim); the paged cache holds only those (kernels/mla.py), a
fraction of full K and V. The query's no-RoPE part is absorbed into latent space with kv_b_proj's
key half, attention runs over the latent cache, and kv_b_proj's value half expands the result.

The first `first_k_dense_replace` layers have a dense MLP, the rest a routed MoE with shared
experts, so the layers form two stacks, each run under its own `lax.scan` by the shared backbone
(models/decoder.py); what is DeepSeek's own is the attention, its cache and the config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.kernels import (
    AttentionBackend,
    AttentionMetadata,
    KVCacheSpec,
    MLACache,
)
from xlaserve.kernels.dtype_ops import matmul
from xlaserve.models.decoder import DecoderOnlyLM
from xlaserve.models.layers import GatedMLP, LayerSpec, Linear, RMSNorm
from xlaserve.models.moe import MoEConfig, SparseMoeBlock, stack_expert_tensors
from xlaserve.models.rope import apply_rope, rope_angles, rope_attention_factor

# DeepSeek's q_a_layernorm and kv_a_layernorm keep RMSNorm's default eps whatever the config says.
_LORA_NORM_EPS = 1e-6


def deepseek_moe_fields(hf: dict[str, Any], *, shared_default: int = 0, dense_default: int = 0) -> dict:
    """DeepSeekMoE's spellings (DeepSeek V2/V3, GLM-4.5): routed and shared experts, their output
    scale, the dense first layers (clamped to the decoder's, so an MTP layer past it is an MoE one).
    The defaults are the family's Hugging Face config's for a config.json that omits a key."""
    return {
        "num_experts": hf["n_routed_experts"],
        "routed_scaling_factor": float(hf.get("routed_scaling_factor") or 1.0),
        "n_shared_experts": hf.get("n_shared_experts", shared_default) or 0,
        "first_k_dense_replace": min(
            hf.get("first_k_dense_replace", dense_default) or 0, hf["num_hidden_layers"]
        ),
    }


def v3_routing_fields(hf: dict[str, Any]) -> dict:
    """DeepSeek V3's router (GLM-4.5's too): sigmoid scores, a learned bias for the choice, groups
    scored by their best two experts."""
    return {
        "scoring_func": "sigmoid",
        "group_score": "top2_sum",
        "has_score_correction_bias": True,
        "n_group": hf.get("n_group") or 1,
        "topk_group": hf.get("topk_group") or 1,
    }


@dataclass(frozen=True)
class DeepseekConfig(MoEConfig):
    """What V2 and V3 read alike: MLA's ranks and head dims, the dense first layers, shared experts.
    Routing differs between them (`DeepseekV2Config`, `DeepseekV3Config`)."""

    kv_lora_rank: int = 0
    q_lora_rank: int | None = None  # None: q_proj straight from the hidden state (V2-Lite)
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    first_k_dense_replace: int = 0
    rope_interleave: bool = True  # RoPE pairs (x0, x1), (x2, x3)... rather than halves

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        return {
            **super().fields_from_hf(hf),
            # One latent "KV head" shared by every query head; head_dim is the query/key head's.
            "num_kv_heads": 1,
            "head_dim": hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"],
            **deepseek_moe_fields(hf),
            "kv_lora_rank": hf["kv_lora_rank"],
            "q_lora_rank": hf.get("q_lora_rank"),
            "qk_nope_head_dim": hf["qk_nope_head_dim"],
            "qk_rope_head_dim": hf["qk_rope_head_dim"],
            "v_head_dim": hf["v_head_dim"],
        }

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 when the config has it."""
        scale = self.head_dim**-0.5
        scaling = self.rope_scaling_dict
        mscale_all_dim = scaling.get("mscale_all_dim")
        if scaling.get("rope_type", scaling.get("type")) == "yarn" and mscale_all_dim:
            mscale = (
                0.1 * mscale_all_dim * math.log(scaling["factor"]) + 1.0 if scaling["factor"] > 1 else 1.0
            )
            scale *= mscale * mscale
        return scale


@dataclass(frozen=True)
class DeepseekV2Config(DeepseekConfig):
    """Softmax routing, greedy or limited to the `topk_group` groups with the best single expert;
    interleaved RoPE always."""

    norm_topk_prob: bool = False  # Hugging Face's DeepseekV2Config default

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        n_group = hf.get("n_group") or 1
        is_limited = hf.get("topk_method", "greedy") == "group_limited_greedy"
        return {
            **super().fields_from_hf(hf),
            "scoring_func": "softmax",
            "group_score": "max",
            "n_group": n_group,
            "topk_group": (hf.get("topk_group") or 1) if is_limited else n_group,
        }


@dataclass(frozen=True)
class DeepseekV3Config(DeepseekConfig):
    """Sigmoid scores with a learned bias for the choice; groups scored by their best two experts."""

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        return {
            **super().fields_from_hf(hf),
            **v3_routing_fields(hf),
            "rope_interleave": bool(hf.get("rope_interleave", True)),
        }


class MLAttention(nnx.Module):
    """Multi-head Latent Attention, absorbed: every step attends over the latent cache."""

    def __init__(self, cfg: DeepseekConfig, backend: AttentionBackend, *, dtype, rngs: nnx.Rngs):
        d, h = cfg.hidden_size, cfg.num_heads
        self.mla_attention = backend.mla_attention  # the jnp reference or the Pallas kernel
        self.write_latent = backend.write_latent  # decode context parallel: only the rank's own tokens
        r, qk_dim = cfg.kv_lora_rank, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        bias = cfg.attention_bias
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(d, h * qk_dim, dtype=dtype, rngs=rngs)
        else:
            self.q_a_proj = Linear(d, cfg.q_lora_rank, use_bias=bias, dtype=dtype, rngs=rngs)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, _LORA_NORM_EPS, dtype=dtype)
            self.q_b_proj = Linear(cfg.q_lora_rank, h * qk_dim, dtype=dtype, rngs=rngs)
        self.kv_a_proj_with_mqa = Linear(d, r + cfg.qk_rope_head_dim, use_bias=bias, dtype=dtype, rngs=rngs)
        self.kv_a_layernorm = RMSNorm(r, _LORA_NORM_EPS, dtype=dtype)
        self.kv_b_proj = Linear(r, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), dtype=dtype, rngs=rngs)
        self.o_proj = Linear(h * cfg.v_head_dim, d, use_bias=bias, dtype=dtype, rngs=rngs)
        self.cfg = cfg

    def _rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:  # [T, H, rope_dim]
        cfg = self.cfg
        if cfg.rope_interleave:
            # Pairs (x0, x1), (x2, x3)... -> halves (x0, x2, ...), (x1, x3, ...). Queries and keys get
            # the same permutation, so their dot products are the interleaved rotation's.
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        scaling = cfg.rope_scaling_dict
        angles = rope_angles(
            positions, cfg.qk_rope_head_dim, cfg.rope_theta, scaling, cfg.max_position_embeddings
        )
        return apply_rope(x, angles, rope_attention_factor(scaling))  # YaRN scales cos and sin

    def __call__(
        self,
        x: jax.Array,  # [T, D]
        positions: jax.Array,  # [T]
        kv_cache: MLACache,
        md: AttentionMetadata,  # already offset to this layer's blocks
        spec: LayerSpec,  # unused: MLA's RoPE is its own (rotated part only, YaRN from the config)
    ) -> tuple[jax.Array, MLACache]:
        cfg = self.cfg
        num_tokens, h, r = x.shape[0], cfg.num_heads, cfg.kv_lora_rank
        dn, dv = cfg.qk_nope_head_dim, cfg.v_head_dim
        q = self.q_proj(x) if cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(num_tokens, h, dn + cfg.qk_rope_head_dim)
        q_nope, q_rope = q[..., :dn], self._rope(q[..., dn:], positions)
        compressed = self.kv_a_proj_with_mqa(x)  # [T, r + rope_dim]
        latent = self.kv_a_layernorm(compressed[:, :r])
        k_rope = self._rope(compressed[:, None, r:], positions)[:, 0]
        new_latent = jnp.concatenate([latent, k_rope], axis=-1)  # [T, r + rope_dim]
        cache = self.write_latent(kv_cache.latent, new_latent, md.slot_mapping, positions=positions)

        w_ukv = self.kv_b_proj.dequantized_kernel(x.dtype).reshape(r, h, dn + dv)  # [r, H, dn + dv]
        # Per head, [T, dn] x [dn, r] and [T, r] x [r, dv] through `matmul`: a decode step's few rows are
        # padded with batch invariance on, as a projection's are (a lone row's dot rounds otherwise).
        w_uk, w_uv = (jnp.transpose(w, (1, 0, 2)) for w in (w_ukv[..., :dn], w_ukv[..., dn:]))  # [H, r, *]
        q_latent = _per_head(q_nope, jnp.swapaxes(w_uk, -1, -2))  # absorb W_uk into the query: [T, H, r]
        out_latent = self.mla_attention(
            q_latent,
            q_rope,
            cache,
            md.kv_lens,
            md.block_tables,
            md.query_start_loc,
            md.num_seqs,
            sm_scale=cfg.softmax_scale,
        )  # [T, H, r]
        out = _per_head(out_latent, w_uv)  # expand with W_uv: [T, H, dv]
        return self.o_proj(out.reshape(num_tokens, h * dv)), MLACache(cache)


def _per_head(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [T, H, a] times w [H, a, b], head by head -> [T, H, b] in x's dtype."""
    return jnp.swapaxes(matmul(jnp.swapaxes(x, 0, 1), w), 0, 1)


class DeepseekDecoderLayer(nnx.Module):
    def __init__(
        self, cfg: DeepseekConfig, backend: AttentionBackend, *, is_moe: bool, dtype, rngs: nnx.Rngs
    ):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = MLAttention(cfg, backend, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = (
            SparseMoeBlock(cfg, dtype=dtype, rngs=rngs) if is_moe else GatedMLP(cfg, dtype=dtype, rngs=rngs)
        )

    def __call__(self, x, positions, kv_cache: MLACache, md: AttentionMetadata, spec: LayerSpec):
        h, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, md, spec)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv_cache


class LeadingDenseLayers:
    """The hooks of a decoder whose first `first_k_dense_replace` layers have a dense MLP and the rest
    an MoE (DeepSeek V3, GLM-4.5): a stack of each, and a checkpoint whose MTP layers are stored past
    num_hidden_layers."""

    @classmethod
    def layer_stacks(cls, cfg) -> dict[str, range]:
        """The first `first_k_dense_replace` layers (dense MLP), then the rest (MoE); empty ones left out."""
        k = cfg.first_k_dense_replace
        stacks = {"dense_layers": range(k), "moe_layers": range(k, cfg.num_layers)}
        return {name: layers for name, layers in stacks.items() if len(layers)}

    @classmethod
    def prepare_hf_tensors(cls, cfg, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # Checkpoints may carry multi-token-prediction layers past num_hidden_layers: not the decoder's
        # (models/mtp.py loads the first as the drafter of `{"method": "mtp"}`).
        mtp = tuple(f"model.layers.{i}." for i in range(cfg.num_layers, cfg.num_layers + 8))
        kept = {n: t for n, t in tensors.items() if not n.startswith(mtp)}
        return stack_expert_tensors(kept, cfg.num_experts)


class DeepseekV3ForCausalLM(LeadingDenseLayers, DecoderOnlyLM):
    """The shared backbone over two stacks of layers (dense MLP, then MoE) and the latent cache."""

    config_class = DeepseekV3Config

    @classmethod
    def kv_cache_spec(cls, cfg: DeepseekConfig) -> KVCacheSpec:
        """One latent cache: [num_layers * num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]."""
        return KVCacheSpec(cfg.num_layers, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim, cache_class=MLACache)

    @classmethod
    def make_layer(
        cls, cfg: DeepseekConfig, backend: AttentionBackend, stack: str, *, dtype, rngs: nnx.Rngs
    ) -> DeepseekDecoderLayer:
        # `backend.mla_attention`: kernels/mla.py's reference, or the Pallas kernel (ragged_paged_mla.py).
        return DeepseekDecoderLayer(cfg, backend, is_moe=stack == "moe_layers", dtype=dtype, rngs=rngs)


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """V2 (and V2-Lite, V2.5): softmax routing, greedy or limited to the `topk_group` groups with the
    best single expert, no score bias, interleaved RoPE always; everything else is V3's.

    `norm_topk_prob` is honoured as DeepSeek's own code and vLLM do (Hugging Face's V2 router ignores
    it; the released configs set it false, where the two agree).
    """

    config_class = DeepseekV2Config
