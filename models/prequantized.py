"""Which quantization a model is loaded with: `--quantization`, or the checkpoint's own.

- A float checkpoint with `--quantization int8|fp8`: every projection quantized at load, per output
  channel (models/quantization.py).
- A checkpoint released quantized, as vLLM reads them from config.json's `quantization_config`:
  - `quant_method: fp8` with `weight_block_size` [128, 128] (DeepSeek-V3's release): float8_e4m3fn
    weights and `{name}_scale_inv` [out / 128, in / 128], the factor each block is multiplied by;
    without a block size, a per-tensor `{name}_scale` (vLLM's own fp8 serialization);
  - `quant_method: compressed-tensors` with 8-bit float weights (the "FP8-Dynamic" releases):
    `{name}_scale` [out, 1] per channel (strategy "channel"), or one per tensor ("tensor").
  Their weights are kept as stored, with their scales; activation scales (`input_scale`) and KV
  scales (`k_scale`, `v_scale`) are not used (activations stay in the compute dtype on CPU; the KV
  cache's scale is 1.0: engine/QUANTIZATION.md).
- A quantized GGUF with `--quantization gguf`: models/gguf_quant.py.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from xlaserve.models.mxfp4 import decode_mxfp4_tensors
from xlaserve.models.quantization import QUANT_DTYPES, QuantizedTensor, QuantScheme

_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
# Tensors of a quantized checkpoint that no module reads (static activation and KV-cache scales).
_UNUSED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale", ".kv_scale", ".weight_zero_point")


def quantization_scheme(
    method: str | None, hf_config: dict[str, Any], tensors
) -> tuple[QuantScheme | None, Any]:
    """(the scheme the model's projections are stored in or None, the tensors with a quantized
    checkpoint's weights and scales joined as `QuantizedTensor`s). ValueError for a
    `quantization_config` this loader does not read, naming its fields."""
    config = hf_config.get("quantization_config")
    if config is None or not isinstance(tensors, dict) or type(tensors) is not dict:
        if method == "compressed-tensors":
            raise ValueError("quantization='compressed-tensors' needs a checkpoint whose config.json says so")
        if method == "gguf":
            return _gguf_scheme(tensors)
        return QuantScheme.from_method(method), tensors
    kind = config.get("quant_method")
    if kind == "fp8":
        block = config.get("weight_block_size")
        if block is not None:
            bo, bi = (int(b) for b in block)
            scheme = QuantScheme(QUANT_DTYPES["fp8"], block=(bi, bo), checkpoint_only=True)
            tensors = _join_scales(tensors, "_scale_inv", block=(bo, bi))
        else:
            scheme = QuantScheme(QUANT_DTYPES["fp8"], checkpoint_only=True)
            tensors = _join_scales(tensors, "_scale")
    elif kind == "compressed-tensors":
        scheme = QuantScheme(QUANT_DTYPES["fp8"], checkpoint_only=True)
        tensors = _compressed_tensors(config, tensors)
    elif kind == "mxfp4":  # gpt-oss's experts: decoded to bfloat16 here (no 4-bit matmul), then as asked
        return QuantScheme.from_method(method), decode_mxfp4_tensors(tensors)
    else:
        raise ValueError(
            f"quantization_config.quant_method={kind!r} is not supported: expected 'fp8' (block or "
            "per-tensor scales), 'compressed-tensors' (8-bit float weights) or 'mxfp4' (decoded at load)"
        )
    if method == "int8":
        scheme = QuantScheme.from_method(method)  # requantized from the dequantized weights
    return scheme, tensors


def _compressed_tensors(config: dict[str, Any], tensors: dict) -> dict:
    for group in (config.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if weights.get("num_bits") != 8 or weights.get("type") != "float":
            raise ValueError(
                "compressed-tensors: only 8-bit float weights (FP8) are supported, got "
                f"num_bits={weights.get('num_bits')}, type={weights.get('type')!r}"
            )
        if weights.get("strategy") not in ("channel", "tensor"):
            raise ValueError(
                f"compressed-tensors: weight strategy {weights.get('strategy')!r} is not supported "
                "(expected 'channel' or 'tensor')"
            )
    return _join_scales(tensors, "_scale")


def _join_scales(tensors: dict, suffix: str, block: tuple[int, int] | None = None) -> dict:
    """`{name}.weight` (float8) with `{name}.weight{suffix}` -> one QuantizedTensor; scales of any
    shape become q's rank (a scalar: per tensor; [out]: per channel; [out / b, in / b]: blocks)."""
    out = {}
    for name, array in tensors.items():
        if name.endswith(suffix) or name.endswith(_UNUSED_SUFFIXES):
            continue
        scale = tensors.get(name + suffix)
        if scale is None or np.dtype(array.dtype).itemsize != 1:
            out[name] = array
            continue
        scale = np.asarray(scale, np.float32)
        if scale.size == 1:  # per tensor: the same scale for every output channel
            scale = np.full((*array.shape[:-1], 1), scale.reshape(()), np.float32)
        elif scale.ndim < array.ndim:  # per channel [.., out]
            scale = scale[..., None]
        q = array if np.dtype(array.dtype) == _FP8 else np.asarray(array).view(_FP8)
        out[name] = QuantizedTensor(q, scale, block=block)
    return out


def _gguf_scheme(tensors):
    from xlaserve.models.gguf_quant import gguf_scheme

    return gguf_scheme(tensors)
