"""Granite 4.0-H (GraniteMoeHybridForCausalLM): Mamba2 layers beside attention layers, each with a
mixture of experts and a shared MLP, and Granite's scalings.

On the hybrid backbone (models/hybrid.py): a recurrent layer is Mamba2's mixer (models/mamba2.py,
its conv and SSM state in the layer's state slot), an attention layer the shared `Attention` with
RoPE, or with no position embedding at all when `position_embedding_type` is not "rope". Every layer
is x + m * mixer(norm(x)), then x + m * (moe(norm(x)) + shared_mlp(norm(x))) with m the
`residual_multiplier`; the embeddings are scaled by `embedding_multiplier`, the scores by
`attention_multiplier` (in place of head_dim^-0.5), the logits divided by `logits_scaling`. The
experts route by softmax over the top k router logits (the same weights as a softmax over all
experts renormalized over the top k). A config without experts (`num_local_experts` 0) has the
shared MLP alone.

Checkpoints store each layer's experts fused (`block_sparse_moe.input_linear` [E, 2F, D]: gate, then
up; `output_linear` [E, D, F]; `router.layer`) and the shared MLP's gate and up as one
`input_linear`; `prepare_hf_tensors` splits them into our modules' names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx

from xlaserve.kernels import AttentionBackend, AttentionMetadata, KVCache
from xlaserve.kernels.hybrid_cache import HybridCache
from xlaserve.kernels.ssd import MambaCache
from xlaserve.models.granite import granite_expert_tensors, granite_scalings
from xlaserve.models.hybrid import HybridConfig
from xlaserve.models.layers import Attention, GatedMLP, LayerSpec, RMSNorm
from xlaserve.models.mamba2 import Mamba2Mixer, group_mamba2_tensors
from xlaserve.models.mamba2_hybrid import Mamba2HybridConfig, Mamba2HybridLM
from xlaserve.models.moe import MoEConfig, SparseMoeBlock
from xlaserve.models.safetensors_loader import split_halves


@dataclass(frozen=True)
class GraniteHybridConfig(MoEConfig, Mamba2HybridConfig):
    """The attention and MoE fields (MoEConfig, `intermediate_size` being each expert's width), the
    shared MLP's width, Granite's scalings, and the Mamba2 mixer's fields."""

    shared_intermediate_size: int = 0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0

    def __post_init__(self):
        if self.num_experts == 0:  # a dense hybrid: the shared MLP alone, no routing to check
            HybridConfig.__post_init__(self)
        else:
            super().__post_init__()

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        num_experts = hf.get("num_local_experts") or 0
        hf = {**hf, "num_experts_per_tok": hf.get("num_experts_per_tok") or 0}
        fields = super().fields_from_hf(hf)
        uses_rope = hf.get("position_embedding_type") == "rope"
        return {
            **fields,
            "num_experts": num_experts,
            "norm_topk_prob": True,  # softmax over the top k logits
            "shared_intermediate_size": hf["shared_intermediate_size"],
            **granite_scalings(hf),
            "partial_rotary_factor": fields["partial_rotary_factor"] if uses_rope else 0.0,
        }


class _GraniteLayer(nnx.Module):
    """The norms, the experts and the shared MLP every layer has; the mixer is the subclass's."""

    # The attention's q/k/v/o are Linears an adapter may target (models/lora.py); Mamba2's in_proj and
    # out_proj, the fused shared MLP (input_linear, output_linear) and the experts are no LoRA target.
    supports_lora = True

    def __init__(self, cfg: GraniteHybridConfig, *, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.block_sparse_moe = SparseMoeBlock(cfg, dtype=dtype, rngs=rngs) if cfg.num_experts else None
        shared = cfg.replace(intermediate_size=cfg.shared_intermediate_size)
        self.shared_mlp = GatedMLP(shared, dtype=dtype, rngs=rngs)
        self.residual_multiplier = cfg.residual_multiplier

    def finish(self, x: jax.Array, h: jax.Array) -> jax.Array:
        m = np.asarray(self.residual_multiplier, x.dtype)
        x = x + h * m
        h = self.post_attention_layernorm(x)
        out = self.shared_mlp(h)
        if self.block_sparse_moe is not None:
            out = self.block_sparse_moe(h) + out
        return x + out * m


class GraniteMambaLayer(_GraniteLayer):
    def __init__(self, cfg: GraniteHybridConfig, backend: AttentionBackend, *, dtype, rngs: nnx.Rngs):
        super().__init__(cfg, dtype=dtype, rngs=rngs)
        self.mamba = Mamba2Mixer(cfg.mamba, backend, dtype=dtype, rngs=rngs)

    def __call__(self, x, cache: HybridCache, md: AttentionMetadata, rows: jax.Array):
        h, state = self.mamba(self.input_layernorm(x), MambaCache(cache.conv, cache.recurrent), md, rows)
        return self.finish(x, h), HybridCache(cache.k, cache.v, state.conv, state.ssm)


class GraniteAttentionLayer(_GraniteLayer):
    def __init__(self, cfg: GraniteHybridConfig, backend: AttentionBackend, *, dtype, rngs: nnx.Rngs):
        super().__init__(cfg, dtype=dtype, rngs=rngs)
        self.self_attn = Attention(cfg, backend, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, cache: HybridCache, md: AttentionMetadata, spec: LayerSpec):
        h, kv = self.self_attn(self.input_layernorm(x), positions, KVCache(cache.k, cache.v), md, spec)
        return self.finish(x, h), HybridCache(kv.k, kv.v, cache.conv, cache.recurrent)


# Checkpoint names -> ours, per layer (the legacy fused names, and transformers 5's in-memory ones).
_MOE = re.compile(r"^(?P<block>.+\.layers\.\d+\.block_sparse_moe)\.(?P<name>[\w.]+)$")
_SHARED = re.compile(r"^(?P<mlp>.+\.layers\.\d+\.shared_mlp)\.(?P<name>input_linear|output_linear)\.weight$")


class GraniteMoeHybridForCausalLM(Mamba2HybridLM):
    config_class = GraniteHybridConfig
    linear_layer_class = GraniteMambaLayer
    attention_layer_class = GraniteAttentionLayer

    @classmethod
    def prepare_hf_tensors(
        cls, cfg: GraniteHybridConfig, tensors: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        out = {}
        for name, tensor in tensors.items():
            if m := _SHARED.match(name):
                if m["name"] == "output_linear":
                    out[f"{m['mlp']}.down_proj.weight"] = tensor
                else:
                    gate, up = split_halves(tensor, axis=0)
                    out[f"{m['mlp']}.gate_proj.weight"], out[f"{m['mlp']}.up_proj.weight"] = gate, up
            elif m := _MOE.match(name):
                parts = granite_expert_tensors(m["block"], m["name"], tensor)
                out.update({name: tensor} if parts is None else parts)  # an unknown one: the loader names it
            else:
                out[name] = tensor
        return group_mamba2_tensors(cfg.mamba, out)

    def compute_logits(self, hidden: jax.Array, head_dv: jax.Array | None = None) -> jax.Array:
        return super().compute_logits(hidden, head_dv) / self.cfg.logits_scaling
