"""A GGUF file's llama.cpp metadata (`llama.block_count`, ...) -> the Hugging Face `config.json` dict
its model would have, so the model code sees one format only (the tensors: models/gguf_loader.py).

What llama.cpp's converter writes is read from the file; what its graph code decides without the file
(Gemma's query scale by layer count, SmolLM3's NoPE layers, gpt-oss's sliding pattern) is written here as
the config keys HF's model reads for it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

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
    # Its block count includes the MTP layers, stored after the decoder's (`_glm4moe_fields`).
    "glm4moe": ("glm4_moe", "Glm4MoeForCausalLM"),
}
# Converted by llama.cpp's LlamaModel (or a subclass), which permutes q/k rows for its rope (see
# `unpermute_qk`).
PERMUTED_QK = ("llama", "smollm3", "granite", "granitemoe")


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
    head_dim = key("attention.key_length") or (key("rope.dimension_count") if arch in PERMUTED_QK else None)
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
        config.update(_deepseek2_fields(metadata, config, names))
    if arch == "glm4moe":
        config.update(_glm4moe_fields(metadata, config, names))
    if arch == "phi3":
        if key("rope.dimension_count"):
            config["partial_rotary_factor"] = key("rope.dimension_count") / head_dim
        # LongRoPE's factors come as tensors (`rope_factors_long`/`_short`), read with the weights.
        config["original_max_position_embeddings"] = key("rope.scaling.original_context_length")
    return config


# llama.cpp's `expert_gating_func` values (gguf's ExpertGatingFuncType).
_GATING_FUNCS = {1: "softmax", 2: "sigmoid"}


def _deepseek2_fields(
    metadata: Mapping[str, Any], config: Mapping[str, Any], names: set[str]
) -> dict[str, Any]:
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
    # llama.cpp scores a group by its best two experts whatever the gating; V2's own rule (and
    # Hugging Face's, vLLM's) is its best one, which the V2 config read here keeps.
    n_group, topk_group = key("expert_group_count", 1), key("expert_group_used_count", 1)
    fields = {
        # attention_bias: biases on q_a, kv_a and o_proj (no released DeepSeek has them; the converter
        # writes them, llama.cpp's graph has none).
        "attention_bias": any(n.endswith(".attn_kv_a_mqa.bias") for n in names),
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


def _glm4moe_fields(
    metadata: Mapping[str, Any], config: Mapping[str, Any], names: set[str]
) -> dict[str, Any]:
    """GLM-4.5's config.json keys from what llama.cpp's Glm4MoeModel writes: its `block_count` counts the
    MTP layers too (`nextn_predict_layers`, blocks after the decoder's), the rotated dims of each head
    are `rope.dimension_count`, and its routing is DeepSeek V3's (sigmoid, the score bias; no groups
    written: the releases have one)."""

    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"glm4moe.{name}", default)

    num_nextn = key("nextn_predict_layers", 0)
    return {
        "num_hidden_layers": config["num_hidden_layers"] - num_nextn,
        "num_nextn_predict_layers": num_nextn,
        "partial_rotary_factor": key("rope.dimension_count", config["head_dim"]) / config["head_dim"],
        "use_qk_norm": any(n.endswith(".attn_q_norm.weight") for n in names),
        "first_k_dense_replace": key("leading_dense_block_count", 0),
        "n_routed_experts": key("expert_count"),
        "n_shared_experts": key("expert_shared_count", 0),
        "routed_scaling_factor": float(key("expert_weights_scale") or 1.0),
        "norm_topk_prob": bool(key("expert_weights_norm", True)),
    }


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


def llama3_rope_scaling(rope_freqs: np.ndarray, config: Mapping[str, Any]) -> dict[str, Any]:
    """HF's llama3 `rope_scaling` for a file's `rope_freqs` tensor (read with the weights)."""
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
