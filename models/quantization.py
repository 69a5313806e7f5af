"""Weight quantization kept on the device: `--quantization int8|fp8` (vLLM's names).

A quantized projection stores its kernel [.., in, out] as int8 or float8_e4m3fn, with float32
scales beside it as another parameter, `kernel_scale`: [.., out] per output channel (symmetric:
scale = max|w| over the input axis / the dtype's max; float8: the scale of least rounding error in the
octave above that, models/fp8_scales.py), or [.., in / 128, out / 128] per block for
checkpoints released that way (DeepSeek-V3's FP8). The step dequantizes inside the jitted matmul
(`kernels/dtype_ops.matmul`): the weight is converted to the compute dtype in the dot and the
accumulator multiplied by the per-channel scale, so device memory holds one byte per weight.

The model is built as usual, then `quantize_modules` swaps the kernel of every quantizable module
(`Linear`, `ExpertLinear`, the LM head, and the embedding table: stored as a kernel [D, V] with one
scale per vocabulary entry, which is also the tied LM head's per-output-channel scale) for a
quantized one, abstractly, before `load_params` fills it: the graph (and so every jitted program)
knows its dtypes from the start, and the loader quantizes each float tensor on the host as it reads
it (`quantize_array`), or places a checkpoint's own quantized tensors and scales as they are.
On CPU a float8 kernel is stored as uint8 words (kernels/dtype_ops.py); the module bitcasts it back.
A GGUF's 4-bit codes are packed two to a byte (`pack_int4`, [.., in / 2, out] uint8) and multiplied
by `dtype_ops.packed_matmul` without unpacking.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from xlaserve.kernels.dtype_ops import as_words, dequantize, from_words, matmul, unpack_int4
from xlaserve.models.fp8_scales import fp8_channel_scales

# --quantization -> the kernel's storage dtype.
QUANT_DTYPES = {"int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn)}

SCALE, ZERO = "kernel_scale", "kernel_zero"  # the parameters beside a quantized kernel
TABLES = ("embed_tokens", "lm_head")  # the modules `QuantScheme.table_dtype` applies to


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """How every quantizable kernel of one model is stored. `block`: the [in, out] extent one scale
    covers (DeepSeek-V3's FP8: (128, 128); GGUF: (32, 1)); None: one scale per output channel.
    `has_zero`: affine (w = q * scale + zero per block, GGUF's formats with mins)."""

    dtype: jnp.dtype
    block: tuple[int, int] | None = None
    has_zero: bool = False
    # A checkpoint released quantized: only the modules it stores quantized are (vLLM keeps the
    # others, e.g. a compressed-tensors `ignore` list, in float). Else every projection.
    checkpoint_only: bool = False
    # The scales' (and zeros') dtype on the device: float16 where every one is a float16 exactly
    # (GGUF's own d and m: half the bytes of float32, still bit-exact).
    scale_dtype: jnp.dtype = jnp.dtype(jnp.float32)
    # The embedding table and LM head's storage when not `dtype` (fp8: int8, see `from_method`).
    table_dtype: jnp.dtype | None = None

    def block_of(self, kernel_shape: tuple[int, ...]) -> tuple[int, int]:
        return (kernel_shape[-2], 1) if self.block is None else self.block

    def scale_shape(self, kernel_shape: tuple[int, ...]) -> tuple[int, ...]:
        """[.., in / b_in, out / b_out] (rounded up): [.., 1, out] per output channel."""
        *lead, din, dout = kernel_shape
        bi, bo = self.block_of(kernel_shape)
        return (*lead, -(-din // bi), -(-dout // bo))

    def packed_kernel_shape(self, kernel_shape: tuple[int, ...]) -> tuple[int, ...]:
        """4-bit codes two to a byte along the input axis: [.., in / 2, out] uint8."""
        *lead, din, dout = kernel_shape
        return (*lead, din // 2, dout)

    def describe(self) -> str:
        block = (
            "per output channel" if self.block is None else f"per [{self.block[0]}, {self.block[1]}] block"
        )
        return f"{jnp.dtype(self.dtype).name}, scales {block}{' with zeros' if self.has_zero else ''}"

    @classmethod
    def from_method(cls, method: str | None) -> QuantScheme | None:
        """`--quantization int8|fp8`. Under fp8 the embedding table and LM head are int8 (per-row
        scales): float8's 3 mantissa bits there cost SmolLM2 +5.3% perplexity, int8's +0.5%."""
        if method is None:
            return None
        table = jnp.dtype(jnp.int8) if method == "fp8" else None
        return cls(QUANT_DTYPES[method], table_dtype=table)

    def for_module(self, path: tuple[str, ...]) -> QuantScheme:
        """The scheme of the module at `path` (the tables may differ: `table_dtype`)."""
        if self.table_dtype is not None and path and path[0] in TABLES:
            return dataclasses.replace(self, dtype=self.table_dtype, table_dtype=None)
        return self


@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
    """A checkpoint's quantized weight in Hugging Face layout: q [.., out, in] (int8 or float8) with
    scales of q's rank, one per block: [.., out, 1] per output channel (compressed-tensors' own
    shape), [.., out / 128, in / 128] for DeepSeek-V3's blocks; zeros like the scales, or None."""

    q: np.ndarray
    scale: np.ndarray
    zero: np.ndarray | None = None
    block: tuple[int, int] | None = None  # the last two axes' block; None: as the shapes divide
    bits: int = 8  # 4: codes in [0, 16), stored two to a byte on the device (GGUF's 4-bit types)

    def transposed(self) -> QuantizedTensor:
        """In our [.., in, out] layout (block scales and zeros transposed with it)."""

        def t(a):
            return None if a is None else np.swapaxes(a, -1, -2)

        block = None if self.block is None else self.block[::-1]
        return QuantizedTensor(t(self.q), t(self.scale), t(self.zero), block, self.bits)

    def dequantized(self) -> np.ndarray:
        """float32, in the layout of `q`."""
        return dequantize_array(self.q, self.scale, self.zero, self.block)


def stack_tensors(arrays: list) -> np.ndarray | QuantizedTensor:
    """np.stack, also of a checkpoint's `QuantizedTensor`s (stacked field by field: MoE experts)."""
    if not any(isinstance(a, QuantizedTensor) for a in arrays):
        return np.stack(arrays)
    if not all(isinstance(a, QuantizedTensor) for a in arrays):  # mixed: dequantize every one
        return np.stack([a.dequantized() if isinstance(a, QuantizedTensor) else a for a in arrays])
    zeros = None if arrays[0].zero is None else np.stack([a.zero for a in arrays])
    stacked = (np.stack([a.q for a in arrays]), np.stack([a.scale for a in arrays]))
    return QuantizedTensor(*stacked, zeros, arrays[0].block, arrays[0].bits)


def dtype_max(dtype) -> float:
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return float(np.iinfo(dtype).max)
    return float(ml_dtypes.finfo(dtype).max)


def _expand_blocks(scale: np.ndarray, shape: tuple[int, ...], block=None) -> np.ndarray:
    for axis, size in zip((-2, -1), block or (None, None)):
        scale = np.repeat(scale, size or -(-shape[axis] // scale.shape[axis]), axis=axis)
    return scale[..., : shape[-2], : shape[-1]]


def quantize_array(w: np.ndarray, scheme: QuantScheme) -> QuantizedTensor:
    """[.., in, out] float -> symmetric quantization in `scheme.dtype` with one scale per block
    (per output channel: blocks of [in, 1]): scale = max |w| over the block / the dtype's largest
    value; float8 per output channel: the scale of least rounding error in one octave above that
    (models/fp8_scales.py). Zeros, when the scheme has them, are 0."""
    dtype = jnp.dtype(scheme.dtype)
    w = np.asarray(w, np.float32)
    *lead, din, dout = w.shape
    bi, bo = scheme.block_of(w.shape)
    if scheme.block is None and not jnp.issubdtype(dtype, jnp.integer):
        scale = fp8_channel_scales(w, dtype)
    else:
        padded = np.zeros((*lead, -(-din // bi) * bi, -(-dout // bo) * bo), np.float32)
        padded[..., :din, :dout] = np.abs(w)
        blocks = padded.reshape(*lead, padded.shape[-2] // bi, bi, padded.shape[-1] // bo, bo)
        scale = blocks.max(axis=(-3, -1)) / dtype_max(dtype)
        scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    # Per channel the scales broadcast ([.., 1, out]); blocks are repeated out to the weight's shape.
    q = w / (scale if scheme.block is None else _expand_blocks(scale, w.shape, (bi, bo)))
    if jnp.issubdtype(dtype, jnp.integer):
        q = np.clip(np.rint(q), -dtype_max(dtype), dtype_max(dtype))
    zero = np.zeros_like(scale) if scheme.has_zero else None
    return QuantizedTensor(q.astype(dtype), scale, zero, (bi, bo))


def dequantize_array(
    q: np.ndarray, scale: np.ndarray, zero: np.ndarray | None = None, block=None
) -> np.ndarray:
    """Host float32 of a quantized array (either layout): q * scale (+ zero), each block's scale
    (`scale` has q's rank: [.., a / b_a, b / b_b]) repeated over its block."""
    w = np.asarray(q).astype(np.float32) * _expand_blocks(np.asarray(scale, np.float32), q.shape, block)
    return w if zero is None else w + _expand_blocks(np.asarray(zero, np.float32), q.shape, block)


class QuantizedKernel:
    """Mixin of a module whose `kernel` may be quantized: `kernel_scale` None means a float kernel."""

    kernel: nnx.Param
    kernel_scale: nnx.Param | None = None
    kernel_zero: nnx.Param | None = None
    quant_dtype: str | None = None  # the kernel's dtype when stored as uint8 words (CPU float8)
    quant_block: tuple[int, int] | None = None  # [in, out] covered by one scale; None: per channel
    quant_packed: bool = False  # 4-bit codes two to a byte: kernel [.., in / 2, out] uint8
    quant_scale_dtype: str | None = None  # "float16": scales stored in 16 bits (see `scales`)

    def stored_kernel(self) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
        """(kernel in its real dtype, scales or None, zeros or None)."""
        return self.decode_kernel(self.kernel[...]), *self.scales()

    def decode_kernel(self, kernel: jax.Array) -> jax.Array:
        """Stored kernel (or a gather of its columns) -> codes in their real dtype."""
        if self.quant_packed:
            return unpack_int4(kernel)
        if self.quant_dtype is not None:
            return from_words(kernel, jnp.dtype(self.quant_dtype))
        return kernel

    def scales(self) -> tuple[jax.Array | None, jax.Array | None]:
        """(scales, zeros); float16 ones are bitcast back: the CPU's layer scan hands any stacked
        16-bit leaf over in the model's 16-bit dtype (kernels/dtype_ops.py: `scan`)."""

        def real(p):
            if p is None:
                return None
            a = p[...]
            if self.quant_scale_dtype is not None and a.dtype != jnp.dtype(self.quant_scale_dtype):
                a = jax.lax.bitcast_convert_type(a, jnp.dtype(self.quant_scale_dtype))
            return a

        return real(self.kernel_scale), real(self.kernel_zero)

    def kernel_shape(self) -> tuple[int, ...]:
        """[.., in, out] of the float kernel this module holds (the embedding: its table transposed)."""
        return self.kernel[...].shape

    def use_kernel(self, kernel: nnx.Param) -> None:
        self.kernel = kernel

    def dequantized_kernel(self, dtype) -> jax.Array:
        """The kernel in `dtype`, for the few callers that need the matrix itself (MLA, experts)."""
        kernel, scale, zero = self.stored_kernel()
        if scale is None:
            return kernel.astype(dtype)
        return dequantize(kernel, scale, dtype, zero, self.quant_block)

    def project(self, x: jax.Array, out_dtype=None) -> jax.Array:
        if self.quant_packed:  # two half-depth dots on the packed bytes (kernels/dtype_ops.py)
            scale, zero = self.scales()
            return matmul(
                x, self.kernel[...], out_dtype, scale=scale, zero=zero, block=self.quant_block, packed=True
            )
        kernel, scale, zero = self.stored_kernel()
        return matmul(x, kernel, out_dtype, scale=scale, zero=zero, block=self.quant_block)


def quantize_modules(model: nnx.Module, scheme: QuantScheme | None, keep=None) -> nnx.Module:
    """Swap the kernel of every `QuantizedKernel` module (projections, the LM head, the embedding
    table) for a zeroed quantized one in `scheme`, with its scales (and zeros); None: the model as
    it is. Meant to run inside the `make_model` of `load_params` (under `nnx.eval_shape`, so nothing
    is computed): the loader fills them. On CPU a float8 kernel is stored as uint8 words
    (kernels/dtype_ops.py). `keep(module path)`: the bits that module's weight is kept in (8; 4:
    codes packed two to a byte; 0: not quantized), or (bits, its [in, out] block) where a
    checkpoint's blocks differ between tensors. Default: every module in 8 bits."""
    if scheme is None:
        return model
    top = scheme
    for path, module in list(nnx.iter_graph(model)):
        if not isinstance(module, QuantizedKernel):
            continue
        scheme = top.for_module(tuple(str(p) for p in path))
        dtype = jnp.dtype(scheme.dtype)
        kept = 8 if keep is None else keep(tuple(str(p) for p in path))
        bits, block = kept if isinstance(kept, tuple) else (int(kept), None)
        if not bits:
            continue
        if block is not None and block != scheme.block:  # a checkpoint's own blocks (GGUF Q6_K: 16)
            scheme = dataclasses.replace(scheme, block=block)
        shape = module.kernel_shape()
        if bits == 4:
            kernel = jnp.zeros(scheme.packed_kernel_shape(shape), jnp.uint8)
            module.quant_packed = True
        else:
            kernel = jnp.zeros(shape, dtype)
            if jax.default_backend() == "cpu":
                kernel = as_words(kernel)
            module.quant_dtype = dtype.name if kernel.dtype != dtype else None
        module.quant_block = scheme.block
        if scheme.scale_dtype != jnp.float32:
            module.quant_scale_dtype = jnp.dtype(scheme.scale_dtype).name
        module.use_kernel(nnx.Param(kernel))
        module.kernel_scale = nnx.Param(jnp.ones(scheme.scale_shape(shape), scheme.scale_dtype))
        if scheme.has_zero:
            module.kernel_zero = nnx.Param(jnp.zeros(scheme.scale_shape(shape), scheme.scale_dtype))
    return model


def is_quantized_kernel(path: tuple[str, ...], expected: dict) -> bool:
    return path[-1] == "kernel" and (*path[:-1], SCALE) in expected


def quantized_parts(
    path: tuple[str, ...], arrays: list, is_stacked: bool, expected: dict, scheme: QuantScheme
) -> dict[tuple[str, ...], np.ndarray]:
    """The host arrays of the quantized kernel at `path` and its scales (and zeros), from `arrays`
    (one per stacked layer, or one): float [in, out] arrays are quantized here; a checkpoint's own
    `QuantizedTensor`s (already in our layout) are kept as they are when their dtype and block
    shapes are the model's, and otherwise dequantized and quantized again."""
    scheme = scheme.for_module(path)
    names = ("kernel", SCALE, ZERO)
    shape_of = {name: expected[(*path[:-1], name)] for name in names if (*path[:-1], name) in expected}
    parts: list[QuantizedTensor] = []
    for array in arrays:
        if isinstance(array, QuantizedTensor) and _fits(array, scheme, shape_of, is_stacked):
            parts.append(array)
            continue
        dense = array.dequantized() if isinstance(array, QuantizedTensor) else array
        parts.append(quantize_array(dense, scheme))

    def stacked(get):
        items = [get(p) for p in parts]
        return np.stack(items) if is_stacked else items[0]

    codes = stacked(lambda p: p.q)
    if shape_of["kernel"].shape[-2] * 2 == codes.shape[-2]:  # a 4-bit kernel, packed
        kernel = pack_int4(codes)
    else:
        kernel = storage_array(codes, shape_of["kernel"].dtype)
    scale_dtype = shape_of[SCALE].dtype
    out = {path: kernel, (*path[:-1], SCALE): stacked(lambda p: np.asarray(p.scale, scale_dtype))}
    if ZERO in shape_of:
        out[(*path[:-1], ZERO)] = stacked(
            lambda p: (
                np.zeros_like(p.scale, scale_dtype) if p.zero is None else np.asarray(p.zero, scale_dtype)
            )
        )
    return out


def pack_int4(codes: np.ndarray) -> np.ndarray:
    """[.., in, out] codes in [0, 16) -> [.., in / 2, out] uint8: input 2i in the low nibble, 2i + 1
    in the high one (pairs of adjacent inputs, so a split of the input axis over devices keeps
    whole bytes; `kernels/dtype_ops.unpack_int4` undoes it)."""
    codes = np.asarray(codes).astype(np.uint8)
    if codes.max(initial=0) > 15:
        raise ValueError(f"4-bit codes must lie in [0, 16); got up to {codes.max()}")
    return codes[..., 0::2, :] | (codes[..., 1::2, :] << 4)


def _fits(array: QuantizedTensor, scheme: QuantScheme, shape_of: dict, is_stacked: bool) -> bool:
    scale_shape = shape_of[SCALE].shape[int(is_stacked) :]
    return (
        np.dtype(array.q.dtype) == np.dtype(scheme.dtype)
        and array.scale.shape == tuple(scale_shape)
        # A checkpoint's own tensor shaped its module (`keep` in load_params): its blocks are the module's.
        and (scheme.block is None or array.block == scheme.block or scheme.checkpoint_only)
        and (array.zero is None or ZERO in shape_of)
    )


def storage_array(array: np.ndarray, dtype) -> np.ndarray:
    """A host array of a quantized kernel as the parameter stores it (`dtype`: uint8 words or not)."""
    dtype = np.dtype(dtype)
    if dtype == np.uint8 and array.dtype != np.uint8:
        return np.ascontiguousarray(array).view(np.uint8)
    return np.asarray(array, dtype)


def weight_bytes(params) -> int:
    """Bytes of every parameter array (quantized kernels as stored: int8 or fp8 one byte a weight, 4-bit
    two weights a byte)."""
    return int(
        sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(params) if hasattr(leaf, "dtype"))
    )
