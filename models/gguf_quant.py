"""A quantized GGUF kept quantized (`--quantization gguf`) instead of dequantized at load.

llama.cpp's Q8_0, Q4_0 and Q4_1 store each run of 32 weights along a row (the input axis) as one
block: a float16 scale d (and for Q4_1 a float16 minimum m) and 32 codes, 8-bit or packed 4-bit.
Q4_K stores super-blocks of 256: float16 d and dmin, and per 32 a 6-bit scale sc and minimum mn;
Q6_K super-blocks of 256 hold 6-bit codes, a float16 d and an int8 scale per 16.
Each becomes a `QuantizedTensor` of codes [out, in] with scales (and zeros) per group of inputs:
Q8_0: w = d * q; Q4_0: w = d * q - 8 d (q in [0, 16)); Q4_1: w = d * q + m; Q4_K: w = (d sc) q -
(dmin mn), its two products folded into one float32 scale and zero per 32 at load; Q6_K: w = (d sc)
(q - 32), int8 codes with a float32 scale per 16 (a block of its own within the model). Those are
the numbers llama.cpp's dequantization gives (`gguf.quants.dequantize`, bit for bit), computed inside
the jitted matmul instead. 4-bit codes are packed two to a byte on the device
(models/quantization.py: `pack_int4`); scales and zeros stay float16 when every one is a float16
(Q8_0, Q4_0, Q4_1: GGUF's own numbers), else float32 (the K types' folded products). Other types
(Q5_K, Q3_K, Q2_K, ...) and float tensors are dequantized as before and stay float.

Opt-in: the default path (the embedded SmolLM2's parity with Hugging Face) dequantizes everything
to float32, as before."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K

from xlaserve.models.gguf_reader import read_block_fields, read_tensor_data
from xlaserve.models.quantization import QuantizedTensor, QuantScheme

GROUP = 32  # weights per block (per Q4_K sub-block), along the input axis
SUPER = 256  # weights per K-quant super-block
Q6_K_GROUP = 16  # Q6_K's scales are per 16 weights
# The scheme of a model with any kept block: codes, one scale and zero per [32 in, 1 out].
GGUF_SCHEME = QuantScheme(jnp.dtype(jnp.int8), block=(GROUP, 1), has_zero=True, checkpoint_only=True)
KEPT_TYPES = (
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q6_K,
)


def _f16(column: np.ndarray) -> np.ndarray:
    return column.copy().view(np.float16).astype(np.float32)[:, 0]


# The block types `dequantize` computes here: (bytes a block, where the codes start).
_FAST_TYPES = {
    GGMLQuantizationType.Q8_0: (34, 2),
    GGMLQuantizationType.Q4_0: (18, 2),
    GGMLQuantizationType.Q4_1: (20, 4),
}


def dequantize(raw: np.ndarray, tensor_type) -> np.ndarray | None:
    """A Q8_0 / Q4_0 / Q4_1 tensor's raw bytes -> its float32 weights, flat, bit for bit what
    `gguf.quants.dequantize` gives (the same products and sums, in the same order) in a few whole-array
    passes: ~2.7x faster on the embedded SmolLM2's Q4_1 matrices (0.36 s against 0.97 s), most of a warm
    start's checkpoint time. None for any other type (the caller falls back to gguf's)."""
    if tensor_type not in _FAST_TYPES:
        return None
    block_bytes, start = _FAST_TYPES[tensor_type]
    data = np.asarray(raw).view(np.uint8).reshape(-1, block_bytes)
    d = data[:, 0:2].copy().view(np.float16).astype(np.float32)  # [blocks, 1]
    if tensor_type == GGMLQuantizationType.Q8_0:
        out = data[:, start:].copy().view(np.int8).astype(np.float32)
        out *= d
        return out.reshape(-1)
    packed = data[:, start:]
    codes = np.empty((data.shape[0], GROUP), np.uint8)
    np.bitwise_and(packed, 0x0F, out=codes[:, : GROUP // 2])  # low nibbles first
    np.right_shift(packed, 4, out=codes[:, GROUP // 2 :])
    if tensor_type == GGMLQuantizationType.Q4_0:
        out = (codes.view(np.int8) - np.int8(8)).astype(np.float32)
        out *= d
        return out.reshape(-1)
    out = codes.astype(np.float32)  # Q4_1: d q + m
    out *= d
    out += data[:, 2:4].copy().view(np.float16).astype(np.float32)
    return out.reshape(-1)


def _blocks(raw: np.ndarray, tensor_type) -> np.ndarray:
    """A kept type's raw bytes as [blocks, bytes per block] uint8."""
    _, type_size = GGML_QUANT_SIZES[tensor_type]
    return np.ascontiguousarray(raw, np.uint8).reshape(-1, type_size)


# The bytes of a kept type's block that hold its scales and minimums (`_block_scales` reads no other).
_SCALE_FIELDS = {
    GGMLQuantizationType.Q8_0: slice(0, 2),
    GGMLQuantizationType.Q4_0: slice(0, 2),
    GGMLQuantizationType.Q4_1: slice(0, 4),
    GGMLQuantizationType.Q4_K: slice(0, 16),
    GGMLQuantizationType.Q6_K: slice(192, 210),
}


def _block_scales(data: np.ndarray, tensor_type, start: int = 0) -> tuple[np.ndarray, np.ndarray | None]:
    """A kept type's float32 scales and zeros (None: no zero), [blocks, groups a block], from its
    blocks `data` [blocks, bytes] (`start`: the block's byte `data` starts at, its scale fields'
    when only those were read). Q8_0/Q4_0/Q4_1: d (and Q4_0's -8 d, Q4_1's m), one group a block.
    Q4_K: d * sc and -(dmin * mn) per 32, the products gguf's dequantization computes, so d sc q -
    dmin mn is the same float32 number. Q6_K: d * sc per 16, gguf's (d sc) (q - 32), no zero."""

    def field(first: int, end: int) -> np.ndarray:
        return data[:, first - start : end - start]

    if tensor_type == GGMLQuantizationType.Q4_K:
        d, dmin = _f16(field(0, 2)), _f16(field(2, 4))
        sc, mn = Q4_K.get_scale_min(field(4, 16))  # [n, 8] each: the gguf package's own unpacking
        return d[:, None] * sc.astype(np.float32), -(dmin[:, None] * mn.astype(np.float32))
    if tensor_type == GGMLQuantizationType.Q6_K:
        return _f16(field(208, 210))[:, None] * field(192, 208).copy().view(np.int8).astype(np.float32), None
    d = _f16(field(0, 2))[:, None]
    if tensor_type == GGMLQuantizationType.Q8_0:
        return d, None
    # Q4_0's d (q - 8) as d q + (-8 d): both products and their sum are exact in float32.
    return d, _f16(field(2, 4))[:, None] if tensor_type == GGMLQuantizationType.Q4_1 else -8 * d


def decode_blocks(raw: np.ndarray, tensor_type, shape: tuple[int, int]) -> QuantizedTensor:
    """The raw bytes of a Q8_0/Q4_0/Q4_1/Q4_K/Q6_K tensor of HF `shape` [out, in] -> QuantizedTensor."""
    out_dim, in_dim = shape
    data = _blocks(raw, tensor_type)
    scale, zero = _block_scales(data, tensor_type)
    if tensor_type == GGMLQuantizationType.Q4_K:
        q, group, bits = _q4_k_codes(data), GROUP, 4
    elif tensor_type == GGMLQuantizationType.Q6_K:
        q, group, bits = _q6_k_codes(data), Q6_K_GROUP, 8
    elif tensor_type == GGMLQuantizationType.Q8_0:
        q, group, bits = data[:, 2:34].copy().view(np.int8), GROUP, 8
    else:
        start = 4 if tensor_type == GGMLQuantizationType.Q4_1 else 2
        packed = data[:, start : start + GROUP // 2]
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.int8)  # low nibbles first
        group, bits = GROUP, 4
    groups = (out_dim, in_dim // group)
    return QuantizedTensor(
        q.reshape(out_dim, in_dim),
        scale.reshape(groups),
        None if zero is None else zero.reshape(groups),
        block=(1, group),
        bits=bits,
    )


def _q4_k_codes(data: np.ndarray) -> np.ndarray:
    """Q4_K super-blocks (d, dmin: float16; 12 bytes of 6-bit scales and minimums; 128 bytes of
    codes) -> their 4-bit codes, int8 [n, 256]."""
    # 128 bytes = 4 runs of 32: run j's low nibbles are sub-block 2j, its high nibbles 2j + 1.
    runs = data[:, 16:144].reshape(-1, 4, 1, GROUP)
    return np.concatenate([runs & 0x0F, runs >> 4], axis=2).astype(np.int8).reshape(-1, SUPER)


def _q6_k_codes(data: np.ndarray) -> np.ndarray:
    """Q6_K super-blocks (128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, float16 d) ->
    int8 codes q - 32 (one per byte), [n, 256]."""
    # Each half of 128 weights: 64 bytes of low nibbles (weights 0-63) and high nibbles (64-127), and
    # 32 bytes holding the top 2 bits of weights 32k .. 32k + 31 at bit 2k.
    low = data[:, :128].reshape(-1, 2, 1, 64)
    low = np.concatenate([low & 0x0F, low >> 4], axis=2).reshape(-1, SUPER)
    high = data[:, 128:192].reshape(-1, 2, 1, 32)
    high = np.concatenate([(high >> s) & 0x03 for s in (0, 2, 4, 6)], axis=2).reshape(-1, SUPER)
    return (low | (high << 4)).astype(np.int8) - np.int8(32)


class GGUFBlocks:
    """A GGUF tensor kept quantized (a `KEPT_TYPES` matrix), read from its file and decoded into a
    `QuantizedTensor` (HF layout [out, in]) each time `read()` is called. As a safetensors
    `CheckpointTensor`, it holds the path and offsets, never the bytes nor a view of the mapping.
    `permute`: a row reordering ([out, ...] -> [out, ...]) applied to codes, scales and zeros (llama's
    q/k rows)."""

    __slots__ = ("path", "offset", "tensor_type", "shape", "permute")

    def __init__(self, path: str, offset: int, tensor_type, shape: tuple[int, int], permute=None):
        self.path, self.offset, self.tensor_type, self.shape = path, offset, tensor_type, tuple(shape)
        self.permute = permute

    @property
    def bits(self) -> int:
        return 8 if self.tensor_type in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q6_K) else 4

    @property
    def block(self) -> tuple[int, int]:
        return (1, Q6_K_GROUP if self.tensor_type == GGMLQuantizationType.Q6_K else GROUP)

    @property
    def num_blocks(self) -> int:
        return self.shape[0] * self.shape[1] // GGML_QUANT_SIZES[self.tensor_type][0]

    def _raw(self) -> np.ndarray:
        num_bytes = self.num_blocks * GGML_QUANT_SIZES[self.tensor_type][1]
        return read_tensor_data(self.path, self.offset, np.dtype(np.uint8), (num_bytes,))

    def read(self) -> QuantizedTensor:
        tensor = decode_blocks(self._raw(), self.tensor_type, self.shape)
        return tensor if self.permute is None else permute_rows(tensor, self.permute)

    def scales_fit_float16(self) -> bool:
        """Whether every scale and zero is a float16 number (`gguf_scheme`), from the file's scale
        bytes alone: the codes are read once, by the load's `read()` (6 to 20% of a block is scales)."""
        fields = _SCALE_FIELDS[self.tensor_type]
        type_size = GGML_QUANT_SIZES[self.tensor_type][1]
        data = read_block_fields(self.path, self.offset, type_size, self.num_blocks, fields)
        scale, zero = _block_scales(data, self.tensor_type, fields.start)
        return _is_float16(scale) and (zero is None or _is_float16(zero))

    def __repr__(self) -> str:
        return f"GGUFBlocks({self.path!r}, {self.tensor_type.name}, shape={self.shape})"


def gguf_scheme(tensors) -> tuple[QuantScheme | None, object]:
    """`--quantization gguf`: the scheme when the loader kept any block, else None (nothing to keep).
    Scales in float16 when every kept scale and zero is one (no rounding), else float32."""
    if not isinstance(tensors, dict):
        return None, tensors
    kept = [t for t in tensors.values() if isinstance(t, (QuantizedTensor, GGUFBlocks))]
    if not kept:
        return None, tensors
    if all(_scales_fit_float16(t) for t in kept):  # one tensor's scales read at a time
        return dataclasses.replace(GGUF_SCHEME, scale_dtype=jnp.dtype(jnp.float16)), tensors
    return GGUF_SCHEME, tensors


def _scales_fit_float16(tensor: QuantizedTensor | GGUFBlocks) -> bool:
    if isinstance(tensor, GGUFBlocks):
        return tensor.scales_fit_float16()
    return _is_float16(tensor.scale) and (tensor.zero is None or _is_float16(tensor.zero))


def _is_float16(a: np.ndarray) -> bool:
    return bool(np.array_equal(np.asarray(a, np.float32).astype(np.float16).astype(np.float32), a))


def permute_rows(tensor: QuantizedTensor, permute) -> QuantizedTensor:
    """`permute` ([out, ...] -> [out, ...] row reordering) applied to codes, scales and zeros alike."""
    zero = None if tensor.zero is None else permute(tensor.zero)
    return dataclasses.replace(tensor, q=permute(tensor.q), scale=permute(tensor.scale), zero=zero)
