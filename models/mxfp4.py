"""MXFP4 checkpoint tensors (the OCP microscaling format gpt-oss ships its experts in), decoded at load.

A tensor `name` is stored as two: `name_blocks` [..., rows, G, 16] uint8, two 4-bit E2M1 codes per
byte (the low nibble first), and `name_scales` [..., rows, G] uint8, one power of two per 32 values
(E8M0: 2 ** (s - 127)). Decoded, each row is G * 32 values; the stored rows are the output channels,
so the decoded tensor is transposed to Hugging Face's unquantized layout for these weights,
[..., in, out]. Values are exact in bfloat16 (a 2-bit mantissa times a power of two), which is what
the decoded tensor holds: the model's weights are then bfloat16, never 4-bit (no MXFP4 matmul here).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BLOCKS, SCALES = "_blocks", "_scales"
# E2M1: sign, two exponent bits, one mantissa bit.
FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
FP4_VALUES = np.concatenate([FP4_E2M1, -FP4_E2M1])
SCALE_BIAS = 127


def decode_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[..., rows, G, 16] uint8 codes and [..., rows, G] uint8 exponents -> [..., G * 32, rows] bfloat16."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape or blocks.ndim < 3:
        raise ValueError(
            f"MXFP4 blocks {blocks.shape} and scales {scales.shape} disagree: expected blocks "
            "[..., rows, G, B] and scales [..., rows, G]"
        )
    values = np.empty((*blocks.shape[:-1], blocks.shape[-1] * 2), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - SCALE_BIAS)
    rows = values.reshape(*blocks.shape[:-2], -1)  # [..., rows, in]
    return np.swapaxes(rows, -1, -2).astype(ml_dtypes.bfloat16)


def decode_mxfp4_tensors(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every `name_blocks` / `name_scales` pair replaced by `name`, decoded; other tensors as they are.
    A pair missing its other half is an error naming it."""
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(SCALES) and name[: -len(SCALES)] + BLOCKS in tensors:
            continue
        if not name.endswith(BLOCKS):
            out[name] = tensor
            continue
        base = name[: -len(BLOCKS)]
        if base + SCALES not in tensors:
            raise ValueError(f"MXFP4 tensor {name} has no {base + SCALES} beside it")
        out[base] = decode_mxfp4(tensor, tensors[base + SCALES])
    return out
