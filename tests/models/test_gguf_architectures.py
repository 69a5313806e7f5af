"""GGUF files of qwen3moe, gemma3, phi3, olmo2, smollm3, granite, qwen2moe, deepseek2, olmoe, granitemoe,
gemma2, gpt-oss and glm4moe against transformers and the models they came from.

For each architecture a tiny random HF model (float32, 2 layers, hidden 64) is written as llama.cpp's
convert_hf_to_gguf.py writes it: its tensor names and metadata keys, Gemma's norms stored as 1 + w,
MoE experts stacked, Phi3's LongRoPE factors as tensors, Granite's multipliers as `granite.*_scale`,
DeepSeek's kv_b_proj split per head, gpt-oss's gate and up de-interleaved; the token table in F16, one
attention and one MLP matrix in Q8_0 (gpt-oss's experts in MXFP4), the rest F32. Then `LLM(file)`'s
prefill logits are compared with
- transformers' own reading of the same file (`load_gguf_checkpoint`: an independent reader, so a
  name or layout mistake made alike in this writer and our reader still shows), within 1e-4, and its
  greedy tokens equal;
- the original model's, within what Q8_0 and F16 rounding allow.
transformers reads no olmo2, smollm3, granite, deepseek2, olmoe, granitemoe or glm4moe GGUF (nor,
failing, this gpt-oss one): for those, the first reference is the original model with the file's rounded
tensors put in its place (`rounded_model`).
"""

from __future__ import annotations

import copy
import functools
import types

import gguf
import numpy as np
import pytest
import torch
import transformers

from helpers.family_cases import (
    ENGINE_ARGS,
    MAX_REL_ERR,
    engine_prefill_logits,
    hf_logits,
    one_torch_thread,  # noqa: F401 - an autouse fixture
    randomize_weights,
    rel_err,
)
from helpers.tiny_models import GGUF_NAMES, add_word_tokenizer, elemental_emitters, gguf_writer
from xlaserve import LLM, SamplingParams

VOCAB = 101
NUM_NEW_TOKENS = 4
# Q8_0 and F16 rounding of three tensors moves these tiny models' logits by ~1% of their range.
QUANTIZED_REL_ERR = 3e-2
_TINY = {
    "vocab_size": VOCAB,
    "hidden_size": 64,  # Q8_0 blocks hold 32 values along a row
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
# GGUF architecture -> (transformers config class, model class, config kwargs)
CASES = {
    # Top 2 of 4 experts, renormalized (as llama.cpp's qwen3moe graph always does); q/k norms.
    "qwen3moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(_TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    ),
    # A sliding layer then a global one with linear-scaled RoPE (base 1e6; the sliding one's 10000, as
    # llama.cpp fixes it); tied embeddings; query_pre_attn_scalar = head_dim, as llama.cpp assumes.
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            _TINY,
            tie_word_embeddings=True,
            sliding_window=8,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            },
        ),
    ),
    # Fused qkv_proj / gate_up_proj; RoPE on half of each head, LongRoPE with its short factors.
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            {k: v for k, v in _TINY.items() if k != "head_dim"},  # hidden / heads
            original_max_position_embeddings=64,
            rope_parameters={
                "rope_type": "longrope",
                "short_factor": [1.0, 1.5, 2.0, 2.5],
                "long_factor": [3.0, 5.0, 7.0, 9.0],
                "original_max_position_embeddings": 64,
                "partial_rotary_factor": 0.5,
                "rope_theta": 10000.0,
            },
        ),
    ),
    # Norms after each block; q and k normed over all heads at once.
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", _TINY),
    # Llama's layer, q/k rows permuted as llama's; no RoPE in the fourth layer (llama.cpp's fixed step).
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(_TINY, num_hidden_layers=4)),
    # Llama's layer, q/k rows permuted as llama's, with Granite's four multipliers (none of them 1, and
    # the attention's not head_dim^-0.5).
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(
            _TINY,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.1,
            logits_scaling=8.0,
        ),
    ),
    # Top 2 of 4 experts, not renormalized (llama.cpp's qwen2moe graph never does), q/k/v biases, and the
    # shared expert scaled by its sigmoid gate.
    "qwen2moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            _TINY,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            norm_topk_prob=False,
        ),
    ),
    # MLA (queries through their low rank) with biases on q_a, kv_a and o_proj, a dense layer then V3's
    # routing: sigmoid scores with their bias, top 2 of 4 in the better of 2 groups, renormalized and
    # scaled, a shared expert; YaRN with mscale = mscale_all_dim, as llama.cpp's graph assumes.
    "deepseek2": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            {k: v for k, v in _TINY.items() if k != "head_dim"},
            num_key_value_heads=4,
            first_k_dense_replace=1,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            attention_bias=True,
            kv_lora_rank=32,
            q_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 0.8,
                "mscale_all_dim": 0.8,
            },
        ),
    ),
    # Top 2 of 8 experts, not renormalized (llama.cpp's olmoe graph never does); q and k normed over all
    # heads at once.
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        dict(_TINY, intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
    ),
    # Granite's multipliers around top 2 of 4 experts (softmax over the top k); q/k rows permuted as
    # llama's.
    "granitemoe": (
        "GraniteMoeConfig",
        "GraniteMoeForCausalLM",
        dict(
            {k: v for k, v in _TINY.items() if k != "head_dim"},  # hidden / heads, as the converter's
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            embedding_multiplier=6.0,
            residual_multiplier=0.6,  # large enough for the file's rounding to show past 1e-3
            attention_multiplier=0.1,
            logits_scaling=8.0,
        ),
    ),
    # A sliding layer then a global one (llama.cpp's fixed alternation), attention and final logits
    # soft-capped (tight enough to bind), tied embeddings; query_pre_attn_scalar = head_dim, as llama.cpp
    # assumes but for the 27B.
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            _TINY,
            tie_word_embeddings=True,
            sliding_window=8,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
    ),
    # Sinks, a sliding layer then a full one (llama.cpp's fixed alternation), biased router and experts
    # (HF's gate and up interleaved in one tensor, split by the converter), YaRN; down experts in MXFP4.
    "gpt-oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            _TINY,
            intermediate_size=64,  # 32: the file's rounding flips a token's experts
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        ),
    ),
    # q/k/v biases, q/k norm, half of each head rotated; a dense layer, then V3's routing (sigmoid with its
    # bias, renormalized and scaled) and a shared expert; the MTP layer's block after the decoder's.
    "glm4moe": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        dict(
            _TINY,
            attention_bias=True,
            use_qk_norm=True,
            partial_rotary_factor=0.5,
            first_k_dense_replace=1,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            num_nextn_predict_layers=1,
        ),
    ),
}
# HF module -> llama.cpp tensor, where an architecture's converter names it otherwise than llama's.
_GEMMA_NAMES = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GGUF_NAMES = {
    "qwen3moe": {"mlp.gate": "ffn_gate_inp"},
    "gemma3": _GEMMA_NAMES,
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
    "olmo2": {
        "post_attention_layernorm": "post_attention_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
    "smollm3": {},
    "granite": {},
    "qwen2moe": {
        "mlp.gate": "ffn_gate_inp",
        "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
        "mlp.shared_expert.up_proj": "ffn_up_shexp",
        "mlp.shared_expert.down_proj": "ffn_down_shexp",
        "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    },
    "deepseek2": {
        "mlp.gate": "ffn_gate_inp",
        "self_attn.q_a_proj": "attn_q_a",
        "self_attn.q_a_layernorm": "attn_q_a_norm",
        "self_attn.q_b_proj": "attn_q_b",
        "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
        "self_attn.kv_a_layernorm": "attn_kv_a_norm",
        "self_attn.kv_b_proj": "attn_kv_b",  # whole in older files; split by today's converter
        "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
        "mlp.shared_experts.up_proj": "ffn_up_shexp",
        "mlp.shared_experts.down_proj": "ffn_down_shexp",
    },
    "olmoe": {"mlp.gate": "ffn_gate_inp"},
    "granitemoe": {"block_sparse_moe.router": "ffn_gate_inp"},
    "gemma2": _GEMMA_NAMES,
    "gpt-oss": {"mlp.router": "ffn_gate_inp", "post_attention_layernorm": "post_attention_norm"},
    "glm4moe": {
        "mlp.gate": "ffn_gate_inp",
        "post_attention_layernorm": "post_attention_norm",
        "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
        "mlp.shared_experts.up_proj": "ffn_up_shexp",
        "mlp.shared_experts.down_proj": "ffn_down_shexp",
    },
}
# Config fields transformers' GGUF reading leaves at its defaults (its GGUF_CONFIG_MAPPING has no key for
# them, or llama.cpp keeps them in its code): given to its model from the original's config, so that the
# comparison with it is one of tensors (names, layouts, the norms' offset), the metadata being checked
# against the original model.
_NOT_READ_BY_TRANSFORMERS = {
    "qwen3moe": ("moe_intermediate_size", "norm_topk_prob"),
    "gemma3": ("query_pre_attn_scalar", "layer_types", "rope_parameters"),
    "phi3": ("rope_parameters", "original_max_position_embeddings"),
    "qwen2moe": ("moe_intermediate_size", "shared_expert_intermediate_size"),
    "gemma2": ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"),
}
# Converted by llama.cpp's LlamaModel (or a subclass), which permutes q/k rows for its rope.
_PERMUTED_QK = ("smollm3", "granite", "granitemoe")
# The tensors stored quantized, the rest F32 (as `--outtype f32`, norms always F32).
_QTYPES = {
    "token_embd.weight": gguf.GGMLQuantizationType.F16,
    "blk.0.attn_q.weight": gguf.GGMLQuantizationType.Q8_0,
    "blk.0.attn_qkv.weight": gguf.GGMLQuantizationType.Q8_0,
    "blk.0.attn_q_b.weight": gguf.GGMLQuantizationType.Q8_0,
    "blk.1.ffn_down.weight": gguf.GGMLQuantizationType.Q8_0,
    "blk.1.ffn_down_exps.weight": gguf.GGMLQuantizationType.Q8_0,
}
# gpt-oss's experts: MXFP4, as its released checkpoints are.
_ARCH_QTYPES = {"gpt-oss": {"blk.1.ffn_down_exps.weight": gguf.GGMLQuantizationType.MXFP4}}


def stored_qtype(name: str, arch: str):
    """The type a tensor of the file is stored in (None: F32)."""
    return {**_QTYPES, **_ARCH_QTYPES.get(arch, {})}.get(name)


def make_model(arch: str):
    config_class, model_class, kwargs = CASES[arch]
    config = getattr(transformers, config_class)(**kwargs, attn_implementation="eager")
    config.architectures = [model_class]
    torch.manual_seed(list(CASES).index(arch))
    model = getattr(transformers, model_class)(config).eval()
    randomize_weights(model, norm_center=0.0 if arch in ("gemma2", "gemma3") else 1.0)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's router bias: a buffer, zeros
                buffer.normal_(0.0, 0.3)
        if arch == "gpt-oss":  # MXFP4 values, as the released experts are: the file holds them exactly
            for name, param in model.named_parameters():
                if name.endswith(".experts.down_proj"):
                    mxfp4 = gguf.GGMLQuantizationType.MXFP4
                    param.copy_(torch.from_numpy(stored_values(param.numpy(), mxfp4, arch, name)))
    return model


def gguf_tensors(model, arch: str, split_kv_b: bool = True) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names and layouts, as its converter writes them (DeepSeek's
    kv_b_proj split as today's does, or whole as older ones did)."""
    names = {**GGUF_NAMES, **_GGUF_NAMES[arch]}
    config = model.config
    out = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        value = tensor.detach().numpy().astype(np.float32)
        block = "blk." + name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith(".e_score_correction_bias"):  # renamed e_score_correction.bias by the converter
            out[f"{block}.exp_probs_b.bias"] = value
            continue
        if name.endswith(".self_attn.sinks"):  # named `.weight` by the converter
            out[f"{block}.attn_sinks.weight"] = value
            continue
        if arch == "gpt-oss" and ".mlp.experts." in name:
            out.update(gpt_oss_expert_tensors(block, name.rpartition(".")[2], value))
            continue
        if name.endswith(".kv_b_proj.weight") and split_kv_b:
            # Per head: the key rows transposed ([H, r, nope]), the value rows ([H, v, r]).
            kv_b = value.reshape(config.num_attention_heads, -1, value.shape[-1])
            k_b, v_b = np.split(kv_b, [config.qk_nope_head_dim], axis=1)
            out[f"{block}.attn_k_b.weight"] = np.ascontiguousarray(k_b.swapaxes(1, 2))
            out[f"{block}.attn_v_b.weight"] = np.ascontiguousarray(v_b)
            continue
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            value = value + 1  # Gemma's RMSNorm scales by 1 + w; llama.cpp's by its weight
        module, _, suffix = name.rpartition(".")
        if module.endswith(".experts"):  # [E, 2F, D] gate | up, [E, D, F] down: stacked per expert
            if suffix == "down_proj":
                out[f"{block}.ffn_down_exps.weight"] = value
            else:
                gate, up = np.split(value, 2, axis=1)
                out[f"{block}.ffn_gate_exps.weight"], out[f"{block}.ffn_up_exps.weight"] = gate, up
            continue
        key = module.split(".", 3)[-1]
        if arch in _PERMUTED_QK and key in ("self_attn.q_proj", "self_attn.k_proj"):
            # llama.cpp's permute for its rope: each head's rows [half0 | half1] -> interleaved.
            heads = config.num_attention_heads if key.endswith("q_proj") else config.num_key_value_heads
            value = value.reshape(heads, 2, -1, value.shape[-1]).swapaxes(1, 2).reshape(value.shape)
        if key == "mlp.shared_expert_gate":  # [1, D] -> [D], as llama.cpp's model declares it
            value = value.reshape(-1)
        out[gguf_name(name, names)] = value
    return out


def gpt_oss_expert_tensors(block: str, part: str, value: np.ndarray) -> dict[str, np.ndarray]:
    """GptOssModel's experts: HF's [E, in, out] (gate and up interleaved column by column, biases alike)
    as llama.cpp's [E, out, in] stacks, gate the even columns, up the odd ones."""
    if part.startswith("down_proj"):
        suffix = "bias" if part.endswith("_bias") else "weight"
        return {f"{block}.ffn_down_exps.{suffix}": value if suffix == "bias" else value.swapaxes(-1, -2)}
    if part == "gate_up_proj":
        value = value.swapaxes(-1, -2)
        gate, up = value[:, 0::2], value[:, 1::2]
        suffix = "weight"
    else:
        gate, up = value[..., 0::2], value[..., 1::2]
        suffix = "bias"
    return {
        f"{block}.ffn_gate_exps.{suffix}": np.ascontiguousarray(gate),
        f"{block}.ffn_up_exps.{suffix}": np.ascontiguousarray(up),
    }


def gguf_name(name: str, names: dict[str, str]) -> str:
    """llama.cpp's name for the HF tensor `name` (not a stacked expert's), by the module renames `names`."""
    module, _, suffix = name.rpartition(".")
    if module.startswith("model.layers."):
        _, _, layer, key = module.split(".", 3)
        return f"blk.{layer}.{names[key]}.{suffix}"
    return f"{names[module]}.{suffix}"


def stored_name(name: str, names: dict[str, str]) -> str | None:
    """The llama.cpp tensor that holds the HF tensor `name` whole and in its layout (None where the
    converter splits or renames it otherwise: gate | up experts, DeepSeek's kv_b_proj and router bias)."""
    module, _, suffix = name.rpartition(".")
    if module.endswith(".experts"):
        return f"blk.{module.split('.')[2]}.ffn_down_exps.weight" if suffix == "down_proj" else None
    return gguf_name(name, names) if suffix in ("weight", "bias") else None


def stored_values(value: np.ndarray, qtype, arch: str, name: str) -> np.ndarray:
    """What the file holds for the HF tensor `name` of value `value` stored as `qtype`: rounded along
    its rows (gpt-oss's experts, which the converter transposes, along their other axis)."""
    is_transposed = arch == "gpt-oss" and ".experts." in name
    value = value.swapaxes(-1, -2) if is_transposed else value
    rounded = gguf.quants.dequantize(gguf.quants.quantize(value, qtype), qtype)
    return rounded.swapaxes(-1, -2) if is_transposed else rounded


def rounded_model(original, arch: str):
    """The original model with the file's rounding: each tensor the file stores F16 or Q8_0 replaced by
    what it holds (llama.cpp's q/k row permutation moves whole rows, which Q8_0 rounds one by one), so
    that it computes what the file describes, by an implementation other than ours."""
    model = copy.deepcopy(original)
    names = {**GGUF_NAMES, **_GGUF_NAMES[arch]}
    with torch.no_grad():
        for name, param in model.state_dict().items():
            qtype = stored_qtype(stored_name(name, names), arch)
            if qtype is not None:
                param.copy_(torch.from_numpy(stored_values(param.numpy(), qtype, arch, name)))
    return model


def write_gguf(
    path: str, model, arch: str, split_kv_b: bool = True, mtp: dict | None = None, quantized: bool = True
) -> None:
    """`model` as llama.cpp's converter writes it (`mtp`: glm4moe's MTP block, as `mtp_block_tensors`
    gives it; else a random one); `quantized`: the tensors of `stored_qtype` rounded, else all F32."""
    config = model.config
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    header = copy.copy(config)
    if arch == "deepseek2":  # MLA written as one KV head, the latent's
        header.num_key_value_heads = 1
    if arch == "glm4moe":  # the MTP layers' blocks counted too
        header.num_hidden_layers += config.num_nextn_predict_layers
    writer = gguf_writer(path, header, arch)
    if arch != "gemma2":  # Gemma2Model writes its keys itself, no RoPE base among them (llama.cpp's 10000)
        writer.add_rope_freq_base(rope["rope_theta"])
    tensors = gguf_tensors(model, arch, split_kv_b)
    if arch == "phi3":  # no key_length; the rotated dims, LongRoPE's factors as tensors
        head_dim = config.hidden_size // config.num_attention_heads
        writer.add_rope_dimension_count(int(rope["partial_rotary_factor"] * head_dim))
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
        writer.add_sliding_window(0)
        tensors["rope_factors_long.weight"] = np.array(rope["long_factor"], np.float32)
        tensors["rope_factors_short.weight"] = np.array(rope["short_factor"], np.float32)
    elif arch in _PERMUTED_QK:  # llama's: the head size as rope.dimension_count
        writer.add_rope_dimension_count(
            getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
        )
    elif arch == "deepseek2":
        add_deepseek2_keys(writer, config, rope, split_kv_b)
    elif getattr(config, "head_dim", None):  # as TextModel's, when config.json has it
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if arch in ("olmoe", "granitemoe", "gpt-oss"):
        # TextModel's expert keys only: the experts' width is feed_forward_length.
        writer.add_expert_count(getattr(config, "num_experts", None) or config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if arch == "gpt-oss":  # GptOssModel's
        writer.add_sliding_window(config.sliding_window)
        writer.add_expert_feed_forward_length(config.intermediate_size)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch in ("qwen3moe", "qwen2moe"):
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if arch == "glm4moe":
        add_glm4moe_keys(writer, config, tensors, mtp)
    if arch in ("granite", "granitemoe"):  # the converter's names for the multipliers
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma3":
        writer.add_sliding_window(config.sliding_window)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
        # llama.cpp's own pattern is every sixth layer global; the file says ours (1 sliding, 1 global).
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in config.layer_types])
    add_word_tokenizer(writer, VOCAB)
    for name, value in tensors.items():
        qtype = stored_qtype(name, arch) if quantized else None
        if qtype is None:
            writer.add_tensor(name, value)
        else:
            writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_deepseek2_keys(writer, config, rope, split_kv_b: bool) -> None:
    """DeepseekV2Model's keys (convert_hf_to_gguf.py; the routing ones TextModel's): MLA as one latent
    KV head of kv_lora_rank + rope dims, the per-head sizes as *_mla (as key/value_length before the
    split of kv_b), the leading dense layers, the experts' routing, YaRN's mscale as its log multiplier."""
    qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    writer.add_rope_dimension_count(config.qk_rope_head_dim)
    writer.add_vocab_size(config.vocab_size)
    writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_kv_lora_rank(config.kv_lora_rank)
    if split_kv_b:
        writer.add_key_length(config.kv_lora_rank + config.qk_rope_head_dim)
        writer.add_value_length(config.kv_lora_rank)
        writer.add_key_length_mla(qk_head_dim)
        writer.add_value_length_mla(config.v_head_dim)
    else:
        writer.add_key_length(qk_head_dim)
        writer.add_value_length(config.v_head_dim)
    add_v3_routing_keys(writer, config)
    writer.add_expert_group_count(config.n_group)
    writer.add_expert_group_used_count(config.topk_group)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def add_v3_routing_keys(writer, config) -> None:
    """The leading dense layers and DeepSeek V3's routing, as DeepseekV2Model and Glm4MoeModel write them."""
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_count(config.n_routed_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    writer.add_expert_weights_norm(config.norm_topk_prob)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


def add_glm4moe_keys(writer, config, tensors: dict[str, np.ndarray], mtp: dict | None = None) -> None:
    """Glm4MoeModel's keys (convert_hf_to_gguf.py) and an MTP layer's block after the decoder's: `mtp`'s
    tensors, or its nextn tensors and a norm of its decoder layer (random: a plain start drops them)."""
    writer.add_rope_dimension_count(int(config.head_dim * config.rope_parameters["partial_rotary_factor"]))
    add_v3_routing_keys(writer, config)  # no group counts: Glm4MoeModel writes none
    writer.add_nextn_predict_layers(config.num_nextn_predict_layers)
    if mtp is not None:
        tensors |= mtp
        return
    d, block = config.hidden_size, f"blk.{config.num_hidden_layers}"
    rng = np.random.default_rng(0)
    shapes = {"eh_proj": (d, 2 * d), "enorm": (d,), "hnorm": (d,), "shared_head_norm": (d,)}
    shapes |= {"shared_head_head": (VOCAB, d), "embed_tokens": (VOCAB, d)}
    for name, shape in shapes.items():
        tensors[f"{block}.nextn.{name}.weight"] = rng.normal(size=shape).astype(np.float32)
    tensors[f"{block}.attn_norm.weight"] = np.ones(d, np.float32)


# The MTP layer's own tensors: the checkpoint's names (models/mtp.py) -> llama.cpp's (gguf-py's
# MODEL_TENSOR.NEXTN_*: blk.N.nextn.*).
_NEXTN_NAMES = {
    "eh_proj": "eh_proj",
    "enorm": "enorm",
    "hnorm": "hnorm",
    "shared_head.norm": "shared_head_norm",
    "shared_head.head": "shared_head_head",
    "embed_tokens": "embed_tokens",
}


def mtp_block_tensors(checkpoint: dict[str, np.ndarray], hf, layer, arch: str) -> dict[str, np.ndarray]:
    """The MTP layer of a checkpoint (`checkpoint`'s `model.layers.N.*`, N = num_hidden_layers; `layer`:
    its decoder layer, experts fused as transformers holds them) as llama.cpp writes it: block N's
    decoder tensors under the decoder's names, its own under `nextn.*`."""
    n = hf.config.num_hidden_layers
    block = types.SimpleNamespace(
        config=hf.config,
        state_dict=lambda: {f"model.layers.{n}.{name}": t for name, t in layer.state_dict().items()},
    )
    nextn = {
        f"blk.{n}.nextn.{g}.weight": checkpoint[f"model.layers.{n}.{h}.weight"]
        for h, g in _NEXTN_NAMES.items()
    }
    return gguf_tensors(block, arch) | nextn


def transformers_model(path: str, original, arch: str):
    """The model transformers reads from the GGUF file (`from_pretrained(dir, gguf_file=...)` does
    this, but needs accelerate): its config from the metadata, its tensors dequantized and renamed."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with pytest.MonkeyPatch.context() as patch:
        # transformers rebuilds gguf's (pure) name map once per submodule.
        patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        parsed = load_gguf_checkpoint(
            path, return_tensors=True, model_to_load=original, torch_dtype=torch.float32
        )
    fields = {**parsed["config"], **{k: getattr(original.config, k) for k in _NOT_READ_BY_TRANSFORMERS[arch]}}
    config = transformers.AutoConfig.for_model(**fields, attn_implementation="eager")
    model = getattr(transformers, CASES[arch][1])(config).eval()
    missing, unexpected = model.load_state_dict(parsed["tensors"], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


@pytest.fixture(autouse=True)
def elemental_fusions():
    """The engines compile with XLA:CPU's elemental emitters (helpers/tiny_models.py): ~20% less CPU
    for this module. What it checks, the loader against transformers within 1e-4, holds for either."""
    with elemental_emitters():
        yield


@pytest.mark.parametrize("arch", list(CASES))
def test_gguf_architecture(arch, tmp_path):
    original = make_model(arch)
    path = str(tmp_path / f"tiny-{arch}.gguf")
    write_gguf(path, original, arch)
    llm = LLM(path, **ENGINE_ARGS)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, VOCAB, 21).tolist()
    ours = engine_prefill_logits(llm, ids, first_chunk=11)
    expected = hf_logits(original, ids)
    assert 1e-3 < rel_err(ours, expected) < QUANTIZED_REL_ERR  # rounded, but the same model
    if arch in _NOT_READ_BY_TRANSFORMERS:
        reference = transformers_model(path, original, arch)
    else:
        reference = rounded_model(original, arch)
    assert rel_err(ours, hf_logits(reference, ids)) < MAX_REL_ERR
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    tokens = list(llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0].token_ids)
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=NUM_NEW_TOKENS, min_new_tokens=NUM_NEW_TOKENS
        )
    assert tokens == out[0, len(ids) :].tolist()


def read_gguf(path: str) -> tuple[dict, dict]:
    """The HF config and tensors (as arrays) our loader reads from a GGUF file, without an engine."""
    from xlaserve.models.gguf_config import gguf_hf_config
    from xlaserve.models.gguf_loader import load_gguf_tensors
    from xlaserve.models.gguf_reader import open_gguf, read_gguf_metadata

    reader = open_gguf(path)
    metadata = read_gguf_metadata(reader)
    config = gguf_hf_config(metadata, [t.name for t in reader.tensors])
    tensors = load_gguf_tensors(reader, config, metadata["general.architecture"], progress=False)
    return config, {name: np.asarray(tensor) for name, tensor in tensors.items()}


def test_gguf_deepseek2_config_and_kv_b_of_either_converter(tmp_path):
    """Today's converter splits kv_b_proj per head (k_b transposed, v_b) and writes the per-head sizes
    as *_mla; older ones wrote it whole, the sizes as key/value_length. Both read as the original's."""
    original = make_model("deepseek2")
    configs, tensors = [], []
    for split in (True, False):
        path = str(tmp_path / f"split-{split}.gguf")
        write_gguf(path, original, "deepseek2", split_kv_b=split)
        config, read = read_gguf(path)
        configs.append(config)
        tensors.append(read)
    assert configs[0] == configs[1]
    hf = original.config
    expected = {name: getattr(hf, name) for name in ("kv_lora_rank", "q_lora_rank", "n_group", "topk_group")}
    expected |= {name: getattr(hf, name) for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    expected |= {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": True,
        "first_k_dense_replace": 1,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
    }
    assert {k: configs[0][k] for k in expected} == expected
    assert configs[0]["rope_scaling"] == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "mscale": pytest.approx(0.8),
        "mscale_all_dim": pytest.approx(0.8),
        "attention_factor": 1.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    }
    assert tensors[0].keys() == tensors[1].keys()
    for name, value in tensors[0].items():
        np.testing.assert_array_equal(value, tensors[1][name], err_msg=name)
    state = original.state_dict()
    for name in (
        "model.layers.1.self_attn.kv_b_proj.weight",
        "model.layers.1.self_attn.kv_a_proj_with_mqa.bias",
        "model.layers.1.mlp.gate.e_score_correction_bias",
    ):
        np.testing.assert_array_equal(tensors[0][name], state[name].numpy())


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        # Files from before the key: llama.cpp reads them as V2's softmax; groups limit the choice.
        ({}, {"architectures": ["DeepseekV2ForCausalLM"], "topk_method": "group_limited_greedy"}),
        (
            {"deepseek2.expert_gating_func": 1, "deepseek2.expert_group_count": 1},
            {"architectures": ["DeepseekV2ForCausalLM"], "scoring_func": "softmax", "topk_method": "greedy"},
        ),
        # V2 with groups: the best 2 of 4 compete (scored by their best expert, V2's own rule).
        (
            {
                "deepseek2.expert_count": 8,
                "deepseek2.expert_group_count": 4,
                "deepseek2.expert_group_used_count": 2,
            },
            {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2, "attention_bias": False},
        ),
        (
            {"deepseek2.expert_gating_func": 3},
            r"deepseek2.expert_gating_func 3 is not supported: expected one of \[1, 2\]",
        ),
        (
            {"deepseek2.expert_count": 0},
            r"deepseek2 without experts \(deepseek2.expert_count\) is not supported",
        ),
    ],
)
def test_gguf_deepseek2_routing_metadata(metadata, expected):
    from xlaserve.models.gguf_config import gguf_hf_config

    metadata = {
        "general.architecture": "deepseek2",
        "deepseek2.embedding_length": 64,
        "deepseek2.attention.head_count": 4,
        "deepseek2.rope.dimension_count": 8,
        "deepseek2.attention.key_length": 24,
        "deepseek2.attention.value_length": 12,
        "deepseek2.expert_count": 4,
        "deepseek2.expert_group_count": 2,
        "deepseek2.expert_group_used_count": 1,
        "deepseek2.vocab_size": VOCAB,
        **metadata,
    }
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            gguf_hf_config(metadata, ["token_embd.weight"])
        return
    config = gguf_hf_config(metadata, ["token_embd.weight"])
    assert {k: config[k] for k in expected} == expected
    assert (config["qk_nope_head_dim"], config["v_head_dim"], config["q_lora_rank"]) == (16, 12, None)


def test_gguf_granitemoe_shared_expert_is_refused():
    from xlaserve.models.gguf_config import gguf_hf_config

    metadata = {
        "general.architecture": "granitemoe",
        "granitemoe.embedding_length": 64,
        "granitemoe.attention.head_count": 4,
        "granitemoe.expert_count": 4,
        "granitemoe.expert_shared_feed_forward_length": 32,
        "granitemoe.vocab_size": VOCAB,
    }
    with pytest.raises(
        ValueError, match=r"granitemoe with a shared expert \(GraniteMoeShared\) is not supported"
    ):
        gguf_hf_config(metadata, ["token_embd.weight"])


def test_gguf_gemma2_config_from_llama_cpp_conventions():
    """What llama.cpp's Gemma 2 fixes in its code: every other layer slides, from the first; queries
    scale by head_dim, or by hidden / heads in the 27B (46 layers)."""
    from xlaserve.models.gguf_config import gguf_hf_config
    from xlaserve.models.registry import model_config_from_hf

    metadata = {
        "general.architecture": "gemma2",
        "gemma2.block_count": 4,
        "gemma2.embedding_length": 64,
        "gemma2.feed_forward_length": 96,
        "gemma2.attention.head_count": 4,
        "gemma2.attention.head_count_kv": 2,
        "gemma2.attention.key_length": 32,
        "gemma2.attention.sliding_window": 512,
        "gemma2.attn_logit_softcapping": 50.0,
        "gemma2.final_logit_softcapping": 30.0,
        "gemma2.vocab_size": VOCAB,
    }
    cfg = model_config_from_hf(gguf_hf_config(metadata, ["token_embd.weight"]))
    assert cfg.layer_sliding_windows == (512, None, 512, None)
    assert (cfg.query_pre_attn_scalar, cfg.attn_logit_softcap, cfg.final_logit_softcap) == (32, 50.0, 30.0)
    assert cfg.tie_word_embeddings and cfg.norm_offset == 1.0
    metadata["gemma2.block_count"] = 46
    assert gguf_hf_config(metadata, ["token_embd.weight"])["query_pre_attn_scalar"] == 16


def test_gguf_glm4moe_mtp_layer_drafts_as_the_checkpoints(tmp_path):
    """A GLM-4.5 GGUF with its MTP layer as llama.cpp's converter writes it (block num_hidden_layers: its
    decoder layer's tensors, experts stacked, and `nextn.*`), all F32: `speculative_config={"method":
    "mtp"}` on the file drafts what the safetensors checkpoint's layer drafts, Hugging Face's layers'
    (tests/models/test_mtp.py checks that checkpoint's engine against the same reference), k = 2."""
    from safetensors.numpy import load_file

    from helpers.mtp_cases import hf_drafts, record_drafts, save_deepseek_v3_with_mtp

    # One group of experts, as the releases (Glm4MoeModel writes no group counts).
    directory, hf, layer, wiring = save_deepseek_v3_with_mtp(
        str(tmp_path / "glm"), family="Glm4Moe", n_group=1, topk_group=1
    )
    path = str(tmp_path / "glm-mtp.gguf")
    mtp = mtp_block_tensors(load_file(f"{directory}/model.safetensors"), hf, layer, "glm4moe")
    write_gguf(path, hf, "glm4moe", mtp=mtp, quantized=False)
    llm = LLM(path, **ENGINE_ARGS, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    seen = record_drafts(llm)
    ids = np.random.default_rng(2).integers(3, VOCAB, 9).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    tokens = list(out.outputs[0].token_ids)
    with torch.no_grad():
        expected = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=6, min_new_tokens=6)
    assert tokens == expected[0, len(ids) :].tolist()
    seq = ids + tokens
    steps = [(p, d) for p, d in seen[out.request_id] if p < len(seq) - 1]
    assert len(steps) >= len(tokens) // 2
    assert [d for _, d in steps] == hf_drafts(hf, layer, wiring, seq, [p for p, _ in steps], 2)
