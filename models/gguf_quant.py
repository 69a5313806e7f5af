"""A quantized GGUF kept quantized (`--quantization gguf`) instead of dequantized at load.

llama.cpp's Q8_0, Q4_0 and Q4_1 store each run of 32 weights along a row (the input axis) as one
block: a float16 scale d (and for Q4_1 a float16 minimum m) and 32 codes, 8-bit or packed 4-bit.
Each becomes a `QuantizedTensor` of int8 codes [out, in] with float32 scales (and zeros) [out, in / 32]:
Q8_0: w = d * q; Q4_0: w = d * (q - 8); Q4_1: w = d * q + m. Those are the same numbers llama.cpp's
dequantization gives (`gguf.quants.dequantize`), computed inside the jitted matmul instead; the codes
take one byte each on the device (4-bit codes are not packed two to a byte yet), so a 4-bit GGUF
holds 1.25 bytes per weight (int8 code + two float32 per 32), not 0.56. Other types (Q4_K, Q6_K, ...)
and float tensors are dequantized as before and stay float.

Opt-in: the default path (the embedded SmolLM2's parity with Hugging Face) dequantizes everything
to float32, as before.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType

from xlaserve.models.quantization import QuantizedTensor, QuantScheme

GROUP = 32  # weights per block, along the input axis
# The scheme of a model with any kept block: int8 codes, one scale and zero per [32 in, 1 out].
GGUF_SCHEME = QuantScheme(jnp.dtype(jnp.int8), block=(GROUP, 1), has_zero=True, checkpoint_only=True)
KEPT_TYPES = (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)


def decode_blocks(raw: np.ndarray, tensor_type, shape: tuple[int, int]) -> QuantizedTensor:
    """The raw bytes of a Q8_0/Q4_0/Q4_1 tensor of HF `shape` [out, in] -> QuantizedTensor."""
    out_dim, in_dim = shape
    num_blocks = out_dim * in_dim // GROUP
    data = np.ascontiguousarray(raw, np.uint8).reshape(num_blocks, -1)
    d = data[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    zero = None
    if tensor_type == GGMLQuantizationType.Q8_0:
        q = data[:, 2:34].copy().view(np.int8)
    else:
        start = 4 if tensor_type == GGMLQuantizationType.Q4_1 else 2
        packed = data[:, start : start + GROUP // 2]
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.int8)  # low nibbles first
        if tensor_type == GGMLQuantizationType.Q4_1:
            zero = data[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
        else:
            q -= 8
    groups = (out_dim, in_dim // GROUP)
    return QuantizedTensor(
        q.reshape(out_dim, in_dim),
        d.reshape(groups),
        None if zero is None else zero.reshape(groups),
        block=(1, GROUP),
    )


def gguf_scheme(tensors) -> tuple[QuantScheme | None, object]:
    """`--quantization gguf`: the scheme when the loader kept any block, else None (nothing to keep)."""
    if isinstance(tensors, dict) and any(isinstance(t, QuantizedTensor) for t in tensors.values()):
        return GGUF_SCHEME, tensors
    return None, tensors


def permute_rows(tensor: QuantizedTensor, permute) -> QuantizedTensor:
    """`permute` ([out, ...] -> [out, ...] row reordering) applied to codes, scales and zeros alike."""
    zero = None if tensor.zero is None else permute(tensor.zero)
    return QuantizedTensor(permute(tensor.q), permute(tensor.scale), zero, tensor.block)
