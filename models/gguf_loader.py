"""GGUF checkpoints -> HF-named float32 numpy tensors, read lazily (the config: models/gguf_config.py).

A GGUF file carries its weights under llama.cpp names (`blk.0.attn_q.weight`), quantized, some
rearranged by llama.cpp's converter. We translate them to what a safetensors checkpoint would hold,
so the model code sees one format only. As a
safetensors checkpoint's, each tensor is read from the file (and dequantized) only when the load
uses it, one at a time: a start never holds the whole dequantized model on the host, and nothing
keeps a view of the file's mapping past the header's parse.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from tqdm.auto import tqdm

from xlaserve.models.gguf_config import PERMUTED_QK, llama3_rope_scaling
from xlaserve.models.gguf_quant import KEPT_TYPES, GGUFBlocks
from xlaserve.models.gguf_quant import dequantize as fast_dequantize
from xlaserve.models.gguf_reader import (  # noqa: F401 (open_gguf, read_gguf_metadata: re-exported, moved there)
    open_gguf,
    read_gguf_metadata,
    read_tensor_data,
)
from xlaserve.models.safetensors_loader import CheckpointTensor, DerivedTensor

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
_ARCH_BLOCK_TENSORS["glm4moe"] = {
    **{k: v for k, v in _ARCH_BLOCK_TENSORS["deepseek2"].items() if not k.startswith("attn_")},
    "post_attention_norm": "post_attention_layernorm",
    # The MTP layers' own tensors (DeepSeek V3's names in the checkpoint; models/mtp.py).
    "nextn.eh_proj": "eh_proj",
    "nextn.enorm": "enorm",
    "nextn.hnorm": "hnorm",
    "nextn.shared_head_norm": "shared_head.norm",
    "nextn.shared_head_head": "shared_head.head",
    "nextn.embed_tokens": "embed_tokens",
}
# HF parameter names the converter gives a suffix they lack, restored.
_RENAMES = {
    ".e_score_correction.bias": ".e_score_correction_bias",
    ".self_attn.sinks.weight": ".self_attn.sinks",
}
_BLOCK_TENSOR_RE = re.compile(r"blk\.(\d+)\.((?:nextn\.)?\w+)\.(weight|bias)")
# Consumed into `rope_scaling` (llama3's divisors; Phi3's LongRoPE factors), not parameters of the HF model.
_ROPE_FREQS = "rope_freqs.weight"
_ROPE_FACTORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}


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
    reader: GGUFReader,
    hf_config: dict[str, Any],
    arch: str,
    *,
    progress: bool = True,
    keep_quantized: bool = False,
) -> dict[str, GGUFArray | GGUFBlocks]:
    """Every tensor of a file of llama.cpp architecture `arch` (its `general.architecture`) under its
    HF name and HF shape ([out, in] for linears), dequantized to float32 when used (a `GGUFArray`: read
    from the file then, one at a time, not here).

    A `rope_freqs` tensor is folded into `hf_config["rope_scaling"]` (llama3) instead, as Phi3's
    `rope_factors_long`/`_short` are (LongRoPE).
    `keep_quantized` (`--quantization gguf`): Q8_0, Q4_0, Q4_1, Q4_K and Q6_K matrices stay as their
    blocks, decoded when read into `QuantizedTensor`s (`GGUFBlocks`, models/gguf_quant.py).
    """
    path = reader.data.filename  # both readers map the file
    is_permuted = arch in PERMUTED_QK
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
                hf_config["rope_scaling"] = llama3_rope_scaling(values, hf_config)
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
