"""GGUF checkpoints -> a Hugging Face config dict and HF-named float32 numpy tensors, read lazily.

A GGUF file carries its config as llama.cpp metadata (`llama.block_count`, ...) and its weights
under llama.cpp names (`blk.0.attn_q.weight`), quantized. We translate both to what a
`config.json` + safetensors checkpoint would hold, so the model code sees one format only. As a
safetensors checkpoint's, each tensor is read from the file (and dequantized) only when the load
uses it, one at a time: a start never holds the whole dequantized model on the host, and nothing
keeps a view of the file's mapping past the header's parse.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from tqdm.auto import tqdm

from xlaserve.models.gguf_quant import KEPT_TYPES, GGUFBlocks
from xlaserve.models.gguf_quant import dequantize as fast_dequantize
from xlaserve.models.gguf_reader import (  # noqa: F401 (open_gguf, read_gguf_metadata: re-exported, moved there)
    open_gguf,
    read_gguf_metadata,
    read_tensor_data,
)
from xlaserve.models.safetensors_loader import CheckpointTensor, DerivedTensor

# GGUF architecture -> (HF model_type, HF architectures entry).
SUPPORTED_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "olmo2": ("olmo2", "Olmo2ForCausalLM"),
    "smollm3": ("smollm3", "SmolLM3ForCausalLM"),
    "granite": ("granite", "GraniteForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    # DeepSeek V2's softmax routing, or V3's sigmoid one when the file says so (`_deepseek2_fields`).
    "deepseek2": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "olmoe": ("olmoe", "OlmoeForCausalLM"),
    "granitemoe": ("granitemoe", "GraniteMoeForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gpt-oss": ("gpt_oss", "GptOssForCausalLM"),
}
# The HF model types an architecture's file may also become, by its metadata.
_MORE_MODEL_TYPES = {"deepseek_v3": "deepseek2"}
# Converted by llama.cpp's LlamaModel (or a subclass), which permutes q/k rows for its rope (see
# `unpermute_qk`).
_PERMUTED_QK = ("llama", "smollm3", "granite", "granitemoe")

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Where an architecture's llama.cpp names mean other HF tensors (gguf-py's tensor_mapping.py): Gemma's
# `ffn_norm` is the norm before the MLP, not after attention; Phi3 keeps HF's fused projections, under
# the names of the unfused ones; MoE experts come stacked [E, out, in], as our stacked experts are.
_MOE_TENSORS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts_gate",
    "ffn_up_exps": "mlp.experts_up",
    "ffn_down_exps": "mlp.experts_down",
}
_GEMMA_TENSORS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_ARCH_BLOCK_TENSORS = {
    "qwen3moe": _MOE_TENSORS,
    "gemma3": _GEMMA_TENSORS,
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "olmo2": {
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    # Qwen2-MoE's shared expert and its gate (one logit per token: [D], or [1, D] in newer files).
    "qwen2moe": {
        **_MOE_TENSORS,
        "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
        "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj",
        "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    },
    # MLA's low-rank projections; kv_b_proj whole in older files, split per head in newer ones
    # (`_join_kv_b`); V3's router bias (the converter's `e_score_correction.bias`).
    "deepseek2": {
        **_MOE_TENSORS,
        "attn_q_a": "self_attn.q_a_proj",
        "attn_q_a_norm": "self_attn.q_a_layernorm",
        "attn_q_b": "self_attn.q_b_proj",
        "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm": "self_attn.kv_a_layernorm",
        "attn_kv_b": "self_attn.kv_b_proj",
        "attn_k_b": "self_attn.k_b_proj",
        "attn_v_b": "self_attn.v_b_proj",
        "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
        "ffn_up_shexp": "mlp.shared_experts.up_proj",
        "ffn_down_shexp": "mlp.shared_experts.down_proj",
        "exp_probs_b": "mlp.gate.e_score_correction",
    },
    "olmoe": _MOE_TENSORS,
    # Granite's fused input_linear split into gate and up by the converter, as Mixtral's experts.
    "granitemoe": _MOE_TENSORS,
    "gemma2": _GEMMA_TENSORS,
    # Biased router and experts (gate and up de-interleaved by the converter); the sinks, which it
    # names `.weight`.
    "gpt-oss": {
        **_MOE_TENSORS,
        "post_attention_norm": "post_attention_layernorm",
        "attn_sinks": "self_attn.sinks",
    },
}
# HF parameter names the converter gives a suffix they lack, restored.
_RENAMES = {
    ".e_score_correction.bias": ".e_score_correction_bias",
    ".self_attn.sinks.weight": ".self_attn.sinks",
}
_BLOCK_TENSOR_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Consumed into `rope_scaling` (llama3's divisors; Phi3's LongRoPE factors), not parameters of the HF model.
_ROPE_FREQS = "rope_freqs.weight"
_ROPE_FACTORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}


def gguf_hf_config(metadata: Mapping[str, Any], tensor_names: Iterable[str]) -> dict[str, Any]:
    """The Hugging Face `config.json` dict for a GGUF file's metadata and tensor names."""
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported: expected one of {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    model_type, hf_architecture = SUPPORTED_ARCHITECTURES[arch]
    names = set(tensor_names)

    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{name}", default)

    hidden_size = key("embedding_length")
    num_heads = key("attention.head_count")
    num_kv_heads = key("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):  # per-layer counts; uniform for the supported architectures
        num_kv_heads = max(num_kv_heads)
    head_dim = key("attention.key_length") or (key("rope.dimension_count") if arch in _PERMUTED_QK else None)
    head_dim = head_dim or hidden_size // num_heads
    rope_theta = float(key("rope.freq_base", 10000.0))
    vocab_size = key("vocab_size") or len(metadata["tokenizer.ggml.tokens"])

    config = {
        "architectures": [hf_architecture],
        "model_type": model_type,
        "hidden_size": hidden_size,
        "intermediate_size": key("feed_forward_length") or key("expert_feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(metadata, arch),
        "max_position_embeddings": key("context_length"),
        "vocab_size": vocab_size,
        # llama.cpp writes `output.weight` only when the LM head is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": any(n.endswith(".attn_q.bias") for n in names),
        "mlp_bias": any(n.endswith(".ffn_up.bias") for n in names),
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_token_ids(metadata),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    # Mistral v0.1's window (llama.cpp writes Mistral as "llama"), Phi3's: every layer slides
    # (models/config.py). Phi-4's converter writes 0 for none.
    if key("attention.sliding_window"):
        config["sliding_window"] = int(key("attention.sliding_window"))
    if key("expert_count"):
        config.update(
            num_experts=key("expert_count"),
            num_experts_per_tok=key("expert_used_count"),
            moe_intermediate_size=key("expert_feed_forward_length"),
            # llama.cpp's qwen3moe graph renormalizes the top k weights, its qwen2moe graph does not,
            # unless the file says otherwise.
            norm_topk_prob=bool(key("expert_weights_norm", arch == "qwen3moe")),
        )
    if arch == "qwen2moe":
        config["shared_expert_intermediate_size"] = key("expert_shared_feed_forward_length")
        config["qkv_bias"] = config["attention_bias"]
    if arch in ("granite", "granitemoe"):
        config.update(_granite_fields(metadata, arch, head_dim))
    if arch == "granitemoe":
        if key("expert_shared_feed_forward_length"):
            raise ValueError(
                "GGUF granitemoe with a shared expert (GraniteMoeShared) is not supported: only "
                "GraniteMoeForCausalLM's experts are"
            )
        config["num_local_experts"] = key("expert_count")
    if arch == "gpt-oss":
        config.update(_gpt_oss_fields(metadata, config))
    if arch == "olmoe" and key("attention.clamp_kqv"):
        config["clip_qkv"] = float(key("attention.clamp_kqv"))
    if arch in _GEMMA_27B_LAYERS:
        config.update(_gemma_fields(metadata, arch, config))
    if arch == "smollm3":  # llama.cpp rotates no q/k in every fourth layer, a step the file does not carry
        config["no_rope_layers"] = [int((i + 1) % 4 != 0) for i in range(config["num_hidden_layers"])]
    if arch == "deepseek2":
        config.update(_deepseek2_fields(metadata, config))
    if arch == "phi3":
        if key("rope.dimension_count"):
            config["partial_rotary_factor"] = key("rope.dimension_count") / head_dim
        # LongRoPE's factors come as tensors (`rope_factors_long`/`_short`), read with the weights.
        config["original_max_position_embeddings"] = key("rope.scaling.original_context_length")
    return config


# llama.cpp's `expert_gating_func` values (gguf's ExpertGatingFuncType).
_GATING_FUNCS = {1: "softmax", 2: "sigmoid"}


def _deepseek2_fields(metadata: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """DeepSeek V2/V3's config.json keys from llama.cpp's `deepseek2.*` metadata."""

    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"deepseek2.{name}", default)

    # The converter writes MLA as one latent KV head (key_length = kv_lora_rank + rope dims) and the
    # per-head sizes as key_length_mla / value_length_mla; files from before it split kv_b carry the
    # per-head sizes as key_length / value_length.
    rope_dim = key("rope.dimension_count")
    qk_head_dim = key("attention.key_length_mla") or key("attention.key_length")
    if not key("expert_count"):
        raise ValueError(
            "GGUF deepseek2 without experts (deepseek2.expert_count) is not supported: only DeepSeek V2/V3's "
            "mixture of experts"
        )
    # Files without the key predate it: llama.cpp reads them as softmax (V2, V2.5).
    gating = key("expert_gating_func", 1)
    if gating not in _GATING_FUNCS:
        raise ValueError(
            f"GGUF deepseek2.expert_gating_func {gating!r} is not supported: expected one of "
            f"{sorted(_GATING_FUNCS)} ({', '.join(_GATING_FUNCS.values())})"
        )
    is_v3 = _GATING_FUNCS[gating] == "sigmoid"
    n_group, topk_group = key("expert_group_count", 1), key("expert_group_used_count", 1)
    fields = {
        "num_key_value_heads": config["num_attention_heads"],  # the file's 1 is the latent's
        "head_dim": qk_head_dim,
        "kv_lora_rank": key("attention.kv_lora_rank"),
        "q_lora_rank": key("attention.q_lora_rank"),  # absent: q_proj from the hidden state (V2-Lite)
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": qk_head_dim - rope_dim,
        "v_head_dim": key("attention.value_length_mla") or key("attention.value_length"),
        "first_k_dense_replace": key("leading_dense_block_count", 0),
        "n_routed_experts": key("expert_count"),
        "n_shared_experts": key("expert_shared_count", 0),
        "routed_scaling_factor": float(key("expert_weights_scale") or 1.0),
        "n_group": n_group,
        "topk_group": topk_group,
        "scoring_func": _GATING_FUNCS[gating],
        # V2 limits routing to the best groups only when it has groups (V2-Lite has none).
        "topk_method": "noaux_tc" if is_v3 else ("group_limited_greedy" if n_group > 1 else "greedy"),
    }
    if is_v3:
        fields.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"])
    scaling = config["rope_scaling"]
    if scaling and scaling["rope_type"] == "yarn":
        # llama.cpp's graph scales the softmax by mscale(factor, 10 * yarn_log_multiplier)^2 and leaves
        # cos/sin unscaled: HF's DeepSeek YaRN with mscale = mscale_all_dim.
        mscale = 10 * float(key("rope.scaling.yarn_log_multiplier", 0.0))
        fields["rope_scaling"] = {
            **scaling,
            "mscale": mscale,
            "mscale_all_dim": mscale,
            "attention_factor": 1.0,
            "beta_fast": float(key("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(key("rope.scaling.yarn_beta_slow", 1.0)),
        }
    return fields


def _gpt_oss_fields(metadata: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """gpt-oss's config.json keys the file spells otherwise, or leaves to llama.cpp's code (its sliding
    layers, every other one from the first, are its config's default; its SwiGLU clamp, 7, too)."""
    fields = {"num_local_experts": metadata.get("gpt-oss.expert_count")}
    scaling = config["rope_scaling"]
    if scaling and scaling["rope_type"] == "yarn":
        # The converter keeps only the factor and the original context; gpt-oss's config.json says YaRN's
        # betas (llama.cpp's defaults too) and no truncation of its correction range.
        fields["rope_scaling"] = {
            **scaling,
            "beta_fast": float(metadata.get("gpt-oss.rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(metadata.get("gpt-oss.rope.scaling.yarn_beta_slow", 1.0)),
            "truncate": False,
        }
    return fields


# Gemma's queries scale by (hidden / heads)^-0.5 in the 27B models, by head_dim^-0.5 in the others, as
# their config.json's query_pre_attn_scalar says; llama.cpp tells the 27B by its layer count.
_GEMMA_27B_LAYERS = {"gemma3": 62, "gemma2": 46}


def _gemma_fields(metadata: Mapping[str, Any], arch: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """What llama.cpp's Gemma 2 and 3 take from their own code, not the file, as config.json keys."""
    num_layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    fields = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hidden // config["num_attention_heads"]
        if num_layers == _GEMMA_27B_LAYERS[arch]
        else config["head_dim"],
        "final_logit_softcapping": metadata.get(f"{arch}.final_logit_softcapping"),
    }
    if arch == "gemma2":  # its sliding layers, every other one from the first, are its config's default
        fields["attn_logit_softcapping"] = metadata.get("gemma2.attn_logit_softcapping")
        return fields
    # The sliding layers' RoPE: base 10000, never scaled (the file's scaling is the global layers').
    fields["rope_local_base_freq"] = float(metadata.get("gemma3.rope.freq_base_swa", 10000.0))
    if "sliding_window" in config:  # every sixth layer global, unless the file lists the sliding ones
        pattern = metadata.get("gemma3.attention.sliding_window_pattern", 6)
        sliding = (
            pattern if isinstance(pattern, list) else [(i + 1) % pattern != 0 for i in range(num_layers)]
        )
        fields["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    return fields


def _granite_fields(metadata: Mapping[str, Any], arch: str, head_dim: int) -> dict[str, float]:
    """Granite's four multipliers, which llama.cpp's converter writes as `{arch}.*_scale` only when
    set (non-zero); its graph skips a missing one, the attention's falling back to head_dim^-0.5."""

    def scale(name: str, default: float) -> float:
        return float(metadata.get(f"{arch}.{name}") or default)

    return {
        "embedding_multiplier": scale("embedding_scale", 1.0),
        "residual_multiplier": scale("residual_scale", 1.0),
        "logits_scaling": scale("logit_scale", 1.0),
        "attention_multiplier": scale("attention.scale", head_dim**-0.5),
    }


def _eos_token_ids(metadata: Mapping[str, Any]) -> int | list[int] | None:
    # llama.cpp stops on EOS and also on end-of-turn / end-of-message tokens when the file names them.
    ids = [metadata.get(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
    ids = list(dict.fromkeys(i for i in ids if i is not None))
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else ids


def _rope_scaling(metadata: Mapping[str, Any], arch: str) -> dict[str, Any] | None:
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if kind == "none" or factor in (None, 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        return {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": original}
    raise ValueError(f"GGUF rope scaling type {kind!r} is not supported: expected 'none', 'linear' or 'yarn'")


def llama3_rope_factors(
    head_dim: int,
    rope_theta: float,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> np.ndarray:
    """llama.cpp's `rope_freqs` tensor for HF's llama3 rope scaling: the divisor of each frequency.
    [head_dim/2]"""
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    factors = 1.0 / ((1 - smooth) / factor + smooth)
    factors = np.where(wavelen < original_max_position_embeddings / high_freq_factor, 1.0, factors)
    factors = np.where(wavelen > original_max_position_embeddings / low_freq_factor, factor, factors)
    return factors.astype(np.float32)


def _llama3_rope_scaling(rope_freqs: np.ndarray, config: Mapping[str, Any]) -> dict[str, Any]:
    # The file keeps only the per-frequency divisors; the Llama 3.x parameters that produce them are
    # recovered by trying the published ones (low 1, high 4, original context 8192) and checking.
    factor = float(rope_freqs.max())
    params = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    expected = llama3_rope_factors(config["head_dim"], config["rope_theta"], factor, 1.0, 4.0, 8192)
    if expected.shape != rope_freqs.shape or not np.allclose(expected, rope_freqs, rtol=1e-4):
        raise ValueError(
            "GGUF tensor rope_freqs.weight does not match llama3 rope scaling with low_freq_factor=1, "
            "high_freq_factor=4, original_max_position_embeddings=8192; this rope scaling is not supported"
        )
    return params


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF parameter name for a llama.cpp tensor name of architecture `arch` (None for the RoPE
    tensors folded into the config)."""
    if gguf_name == _ROPE_FREQS or gguf_name in _ROPE_FACTORS:
        return None
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_TENSORS and suffix in ("weight", "bias"):
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    match = _BLOCK_TENSOR_RE.fullmatch(gguf_name)
    block_tensors = {**_BLOCK_TENSORS, **_ARCH_BLOCK_TENSORS.get(arch, {})}
    if match and match[2] in block_tensors:
        name = f"model.layers.{match[1]}.{block_tensors[match[2]]}.{match[3]}"
        return next((name.replace(a, b) for a, b in _RENAMES.items() if name.endswith(a)), name)
    raise ValueError(
        f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent in the supported {arch!r} models"
    )


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time row permutation of q_proj/k_proj (weight [out, in] or bias [out]).

    HF's llama rotates the two halves of each head (`rotate_half`); llama.cpp rotates adjacent pairs.
    Its converter reorders each head's rows from [half0 | half1] to interleaved (h0[0], h1[0], h0[1], ...),
    i.e. reshape(heads, 2, d/2) -> swap -> (heads, d/2, 2). We apply the inverse.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


class GGUFArray(CheckpointTensor):
    """One tensor of a GGUF file under its HF name and shape, dequantized to float32 (llama's q/k rows
    put back in HF's order, Gemma's norms back to HF's (1 + w) weights) from the file each time it is
    used as an array, as a safetensors `CheckpointTensor` is read: it holds the path and offsets, never
    the bytes nor a view of the mapping, so a start holds one dequantized tensor at a time. `astype`
    (the load's cast) is lazy."""

    __slots__ = ("tensor_type", "stored_shape", "num_heads", "norm_shift")

    def __init__(
        self, path: str, offset: int, shape, tensor_type, stored: np.ndarray, num_heads=None, norm_shift=0.0
    ):
        super().__init__(path, offset, shape, np.dtype(np.float32))
        # The stored element dtype (byte order included) and shape: [rows..., bytes per row] uint8 for
        # a block-quantized type.
        self.tensor_type, self.stored_dtype, self.stored_shape = tensor_type, stored.dtype, stored.shape
        self.num_heads, self.norm_shift = num_heads, norm_shift

    def read(self) -> np.ndarray:
        data = read_tensor_data(self.path, self.offset, self.stored_dtype, self.stored_shape)
        values = dequantize_tensor(data, self.tensor_type, self.shape)
        if self.num_heads is not None:
            values = unpermute_qk(values, self.num_heads)
        if self.norm_shift:
            values = values - np.float32(self.norm_shift)
        return values if self.dtype == values.dtype else values.astype(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


def dequantize_tensor(data: np.ndarray, tensor_type, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's stored data (as GGUFReader's `data`) -> float32 of HF `shape`."""
    if tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.asarray(data, dtype=np.float32).reshape(shape)
    fast = fast_dequantize(data, tensor_type)  # Q8_0 / Q4_0 / Q4_1, as gguf's bit for bit
    values = dequantize(data, tensor_type) if fast is None else fast
    return values.astype(np.float32, copy=False).reshape(shape)


def load_gguf_tensors(
    reader: GGUFReader, hf_config: dict[str, Any], *, progress: bool = True, keep_quantized: bool = False
) -> dict[str, GGUFArray | GGUFBlocks]:
    """Every tensor under its HF name and HF shape ([out, in] for linears), dequantized to float32
    when used (a `GGUFArray`: read from the file then, one at a time, not here).

    A `rope_freqs` tensor is folded into `hf_config["rope_scaling"]` (llama3) instead, as Phi3's
    `rope_factors_long`/`_short` are (LongRoPE).
    `keep_quantized` (`--quantization gguf`): Q8_0, Q4_0, Q4_1, Q4_K and Q6_K matrices stay as their
    blocks, decoded when read into `QuantizedTensor`s (`GGUFBlocks`, models/gguf_quant.py).
    """
    path = reader.data.filename  # both readers map the file
    model_types = {model_type: a for a, (model_type, _) in SUPPORTED_ARCHITECTURES.items()}
    arch = {**model_types, **_MORE_MODEL_TYPES}[hf_config["model_type"]]
    is_permuted = arch in _PERMUTED_QK
    # llama.cpp's Gemma 2 and 3 converters store each RMSNorm weight w as 1 + w (its norm multiplies by
    # the weight; HF's by 1 + w).
    norm_shift = 1.0 if arch in ("gemma2", "gemma3") else 0.0
    tensors: dict[str, GGUFArray | GGUFBlocks] = {}
    rope_factors = {}
    for t in tqdm(reader.tensors, desc="Reading GGUF tensor headers", unit="tensor", disable=not progress):
        name = hf_tensor_name(t.name, arch)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
        if name is not None and name.endswith(".shared_expert_gate.weight") and len(shape) == 1:
            shape = (1, *shape)  # squeezed by older converters: HF's Linear(D, 1) weight
        if name is None:  # a few floats, read now
            values = dequantize_tensor(np.array(t.data), t.tensor_type, shape)
            if t.name == _ROPE_FREQS:
                hf_config["rope_scaling"] = _llama3_rope_scaling(values, hf_config)
            else:
                rope_factors[_ROPE_FACTORS[t.name]] = values.tolist()
            continue
        heads = None
        if is_permuted and ".self_attn.q_proj." in name:
            heads = hf_config["num_attention_heads"]
        elif is_permuted and ".self_attn.k_proj." in name:
            heads = hf_config["num_key_value_heads"]
        # Phi3 regroups its fused projections' rows at load (models/phi3.py), which it does on arrays:
        # those two are read dequantized.
        is_fused = name.endswith((".qkv_proj.weight", ".gate_up_proj.weight"))
        if keep_quantized and t.tensor_type in KEPT_TYPES and len(shape) == 2 and not is_fused:
            permute = None if heads is None else functools.partial(unpermute_qk, num_heads=heads)
            tensors[name] = GGUFBlocks(path, t.data_offset, t.tensor_type, shape, permute)
        else:
            shift = norm_shift if name.endswith("norm.weight") else 0.0
            tensors[name] = GGUFArray(path, t.data_offset, shape, t.tensor_type, t.data, heads, shift)
    if rope_factors:
        if set(rope_factors) != set(_ROPE_FACTORS.values()):
            raise ValueError(
                "GGUF LongRoPE needs both rope_factors_long.weight and rope_factors_short.weight"
            )
        hf_config["rope_scaling"] = {"rope_type": "longrope", **rope_factors}
    return _join_kv_b(tensors)


def _join_kv_b(tensors: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek's kv_b_proj from the halves llama.cpp's converter splits it into for its absorbed MLA:
    k_b [H, r, nope] (each head's key rows, transposed) and v_b [H, v, r]; HF's is each head's key rows
    then its value rows, [H * (nope + v), r]. Joined when read, as the experts are stacked."""
    for k_name in [n for n in tensors if n.endswith(".self_attn.k_b_proj.weight")]:
        v_name = k_name.replace(".k_b_proj.", ".v_b_proj.")
        if v_name not in tensors:
            raise ValueError(f"GGUF file has {k_name!r}'s k_b half of kv_b_proj but not its v_b half")
        k_b, v_b = tensors.pop(k_name), tensors.pop(v_name)
        heads, rank, nope = k_b.shape
        shape = (heads * (nope + v_b.shape[1]), rank)

        def join(k_b=k_b, v_b=v_b, shape=shape) -> np.ndarray:
            return np.concatenate([np.swapaxes(k_b.read(), 1, 2), v_b.read()], axis=1).reshape(shape)

        tensors[k_name.replace(".k_b_proj.", ".kv_b_proj.")] = DerivedTensor(
            join, shape, np.float32, source=k_b.path
        )
    return tensors
