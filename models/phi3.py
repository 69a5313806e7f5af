"""Phi-3 / Phi-3.5 / Phi-4-mini: the Llama layer with fused projections and partial RoPE.

Hugging Face stores q, k and v as one `qkv_proj` and gate and up as one `gate_up_proj`; we keep
them fused (one matmul each) but regroup their output columns at load time, so that any contiguous
split of them is a split by head, which is how tensor parallelism cuts a weight (sharding/rules.py):

- qkv_proj: per KV head, its G = num_heads / num_kv_heads query heads, then its k, then its v
  ([K, G + 2, head_dim] flattened) instead of HF's all q, all k, all v. Query head h = kv * G + g,
  so the q heads come out in HF's order, and a device holding some KV heads holds their queries.
- gate_up_proj: gate and up interleaved column by column ([F, 2] flattened) instead of HF's
  gate | up, so a device's slice holds matching gate and up columns.

Neither layout depends on the number of devices. A converted checkpoint holds them regrouped.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from xlaserve.models.config import TransformerConfig
from xlaserve.models.layers import Attention, GatedMLP, Linear
from xlaserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class Phi3Attention(Attention):
    def init_projections(self, cfg: TransformerConfig, *, dtype, rngs: nnx.Rngs) -> None:
        width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, width, use_bias=cfg.attention_bias, dtype=dtype, rngs=rngs)

    def project_qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        cfg = self.cfg
        num_tokens, group = x.shape[0], cfg.num_heads // cfg.num_kv_heads
        # An adapter's B for qkv_proj is regrouped like the kernel (models/lora_adapter.py).
        qkv = self.qkv_proj(x).reshape(
            num_tokens, cfg.num_kv_heads, group + 2, cfg.head_dim
        )  # [T, K, G+2, hd]
        q = qkv[:, :, :group].reshape(num_tokens, -1)  # [T, H * hd]
        return q, qkv[:, :, group].reshape(num_tokens, -1), qkv[:, :, group + 1].reshape(num_tokens, -1)


class Phi3MLP(GatedMLP):
    def init_projections(self, cfg: TransformerConfig, *, dtype, rngs: nnx.Rngs) -> None:
        self.gate_up_proj = Linear(
            cfg.hidden_size, 2 * cfg.intermediate_size, use_bias=cfg.mlp_bias, dtype=dtype, rngs=rngs
        )

    def project_gate_up(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        gate_up = self.gate_up_proj(x).reshape(x.shape[0], -1, 2)  # [T, F, 2]: gate, up per column
        return gate_up[..., 0], gate_up[..., 1]


class Phi3DecoderLayer(LlamaDecoderLayer):
    attention_class = Phi3Attention
    mlp_class = Phi3MLP


def group_qkv_by_kv_head(array: np.ndarray, cfg: TransformerConfig) -> np.ndarray:
    """HF's qkv_proj weight [(H + 2K) * hd, D] (or bias [(H + 2K) * hd]) -> rows grouped per KV head."""
    group, rest = cfg.num_heads // cfg.num_kv_heads, array.shape[1:]
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    q, k, v = np.split(array, [q_rows, q_rows + kv_rows])
    q = q.reshape(cfg.num_kv_heads, group, cfg.head_dim, *rest)
    k = k.reshape(cfg.num_kv_heads, 1, cfg.head_dim, *rest)
    v = v.reshape(cfg.num_kv_heads, 1, cfg.head_dim, *rest)
    return np.concatenate([q, k, v], axis=1).reshape(-1, *rest)


def interleave_gate_up(array: np.ndarray) -> np.ndarray:
    """HF's gate_up_proj weight [2F, D] (or bias [2F]) -> rows gate 0, up 0, gate 1, up 1, ..."""
    gate, up = np.split(array, 2)
    return np.stack([gate, up], axis=1).reshape(array.shape)


class Phi3ForCausalLM(LlamaForCausalLM):
    layer_class = Phi3DecoderLayer

    @staticmethod
    def prepare_hf_tensors(cfg: TransformerConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = dict(tensors)
        for name, array in tensors.items():
            if name.endswith((".qkv_proj.weight", ".qkv_proj.bias")):
                out[name] = group_qkv_by_kv_head(np.asarray(array), cfg)
            elif name.endswith((".gate_up_proj.weight", ".gate_up_proj.bias")):
                out[name] = interleave_gate_up(np.asarray(array))
        return out
