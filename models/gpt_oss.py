"""gpt-oss (20b, 120b): attention with sinks over alternating sliding and full layers, and a mixture of
experts with biases and a clamped SwiGLU.

What differs from the Llama layer:
- attention: biases on q, k, v and o; a learned sink logit per query head that every softmax counts in
  its denominator (a head may attend to nothing: kernels/reference.py); even layers slide over 128
  tokens, odd layers see everything (`layer_types`); YaRN RoPE (factor 32 over 4k).
- MLP: a router with a bias, top-k on its logits and a softmax over the k kept (the same weights as
  a softmax over all experts renormalized over the k); experts whose projections have biases, and
  whose activation clamps: gate <= 7, |up| <= 7, (up + 1) * gate * sigmoid(1.702 * gate).

Checkpoints hold the experts fused, [E, in, out] (gate and up interleaved column by column in
`gate_up_proj`); the released ones store them as MXFP4 blocks and scales, which the loader decodes
to bfloat16 first (config.json's `quantization_config`: models/prequantized.py, models/mxfp4.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from xlaserve.models.moe import ExpertLinear, MoEConfig, Router, grouped_expert_mlp, route


@dataclass(frozen=True)
class GptOssConfig(MoEConfig):
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        # The releases' config.json also spells the top k `experts_per_token` (OpenAI's own name).
        hf = {**hf, "num_experts_per_tok": hf.get("num_experts_per_tok") or hf.get("experts_per_token")}
        fields = super().fields_from_hf(hf)
        return {
            **fields,
            "num_experts": hf["num_local_experts"],
            "moe_intermediate_size": hf["intermediate_size"],
            "norm_topk_prob": True,  # a softmax over the top k logits
            "attention_bias": bool(hf.get("attention_bias", True)),
            "attention_out_bias": bool(hf.get("attention_bias", True)),
            "attention_sinks": True,
            "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)),
            "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
            "rms_norm_eps": hf.get("rms_norm_eps", 1e-5),
        }

    @classmethod
    def default_sliding_layers(cls, hf: dict[str, Any], num_layers: int) -> list[bool]:
        """Hugging Face's default without `layer_types`: even layers slide, odd ones are full."""
        return [i % 2 == 0 for i in range(num_layers)]


def clamped_swiglu(gate: jax.Array, up: jax.Array, *, alpha: float, limit: float) -> jax.Array:
    """gpt-oss's expert activation in float32: (clip(up, +-limit) + 1) * g * sigmoid(alpha * g) with
    g = min(gate, limit)."""
    gate = jnp.minimum(gate.astype(jnp.float32), limit)
    up = jnp.clip(up.astype(jnp.float32), -limit, limit)
    return (up + 1.0) * gate * jax.nn.sigmoid(alpha * gate)


class GptOssMoeBlock(nnx.Module):
    """The router (with its bias) and the biased experts, run as grouped matmuls (models/moe.py)."""

    def __init__(self, cfg: GptOssConfig, *, dtype, rngs: nnx.Rngs):
        d, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        self.gate = Router(cfg, dtype=dtype, rngs=rngs, use_bias=True)
        self.experts_gate = ExpertLinear(e, d, f, dtype=dtype, rngs=rngs, use_bias=True)
        self.experts_up = ExpertLinear(e, d, f, dtype=dtype, rngs=rngs, use_bias=True)
        self.experts_down = ExpertLinear(e, f, d, dtype=dtype, rngs=rngs, use_bias=True)
        self.cfg = cfg

    def __call__(self, x: jax.Array) -> jax.Array:  # [T, D] -> [T, D]
        cfg = self.cfg
        weights, expert_ids = route(cfg, self.gate(x))
        experts = (self.experts_gate, self.experts_up, self.experts_down)
        out = grouped_expert_mlp(
            x,
            weights,
            expert_ids,
            *(e.dequantized_kernel(x.dtype) for e in experts),
            glu=lambda g, u: clamped_swiglu(g, u, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit).astype(
                x.dtype
            ),
            biases=tuple(e.bias[...] for e in experts),
        )
        return out


class GptOssDecoderLayer(LlamaDecoderLayer):
    mlp_class = GptOssMoeBlock
    supports_lora = False  # its experts are no LoRA target, and the engine refuses LoRA for it


# "{block}.experts.gate_up_proj[_bias]" / "{block}.experts.down_proj[_bias]" (after MXFP4 decoding).
_FUSED = re.compile(
    r"^(?P<block>.+\.layers\.\d+\.mlp)\.experts\.(?P<proj>gate_up_proj|down_proj)(?P<bias>_bias)?$"
)


class GptOssForCausalLM(LlamaForCausalLM):
    config_class = GptOssConfig
    layer_class = GptOssDecoderLayer

    @classmethod
    def prepare_hf_tensors(cls, cfg: GptOssConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The router renamed to our `gate`; the fused expert stacks ([E, in,
        out], gate and up interleaved by column) split into our per-projection stacks, in the
        loader's [E, out, in] layout, with their biases beside them."""
        out: dict[str, np.ndarray] = {}
        for name, array in tensors.items():
            if ".mlp.router." in name:
                out[name.replace(".mlp.router.", ".mlp.gate.")] = array
                continue
            m = _FUSED.match(name)
            if m is None:
                out[name] = array
                continue
            block, leaf = m["block"], "bias" if m["bias"] else "weight"
            if m["proj"] == "down_proj":
                out[f"{block}.experts_down.{leaf}"] = array if m["bias"] else np.swapaxes(array, -1, -2)
                continue
            gate, up = array[..., 0::2], array[..., 1::2]
            if not m["bias"]:
                gate, up = np.swapaxes(gate, -1, -2), np.swapaxes(up, -1, -2)
            out[f"{block}.experts_gate.{leaf}"] = np.ascontiguousarray(gate)
            out[f"{block}.experts_up.{leaf}"] = np.ascontiguousarray(up)
        return out
