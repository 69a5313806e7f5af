"""Matmuls, gathers and scatters that stay in a 16-bit float dtype on every backend.

XLA's CPU backend computes a bfloat16 dot, gather or scatter by converting its operands to float32
first. Inside a jitted step those operands are loop-invariant (stacked layer weights, the KV cache,
the embedding table), so the converts are hoisted out of the layer loop: every step then converts
the whole model and the whole cache to float32 and back, and a bfloat16 engine ran ~20x slower than
a float32 one (engine/PERFORMANCE.md). These forms avoid that everywhere and cost nothing on a GPU:
- a dot with `preferred_element_type=float32` is native on CPUs with AVX512-BF16 or AMX (and is
  what a GPU's tensor cores do anyway): bfloat16 inputs, float32 accumulation;
- a gather or scatter of 16-bit floats runs on the same bits seen as uint16. A bitcast of a whole
  array is a copy on XLA's CPU backend, so the reference backend *stores* a 16-bit KV cache as
  words (`AttentionBackend.cache_words`) and bitcasts only the pages it gathers; stacked layer
  weights are bitcast once per step (`scan`), on CPU only;
- a bfloat16 weight packed at load (`cpu_dot.PackedWeight`: a bfloat16 engine on one CPU device)
  goes to a C++ dot whose sums are ordered by K alone, read in place from its layer stack;
- a dot of few 16-bit rows (a batch-1 decode step) takes kernels of its own: XLA CPU's matrix-vector
  path for one row, which is not native (7-10x slower than four rows for the LM head ([1, 576] x
  [576, 49152]), 2x for a projection: engine/PERFORMANCE.md), and for a few rows kernels that round
  differently from the one larger dots share. Measured with YNNPACK's dots (jax 0.10.2, an AMX CPU): a
  row's bits are the same in every M from a threshold on, and the threshold depends on the shape (3
  for SmolLM2's projections and LM head, up to 11 for a [M, 12] x [12, 48] one). `matmul` pads fewer
  than `MIN_DOT_ROWS` rows to it, so a token's projections have the same bits alone as among companions
  (batch invariance, kernels/invariant.py), and a batch-1 step is no slower (16 rows cost what 4 do:
  the weights' reads dominate); by an int8 weight, one row is split exactly into two int8 rows instead
  and multiplied in integers (`split_int8_matmul`). With float32's batch invariance asked for too
  (`--batch-invariant-float32`, `invariant.covers_float32()`), a float32 dot of few rows is padded
  alike (its own probed threshold: 2 rows for every shape on an AVX512-BF16 EPYC), since its one-row
  matrix-vector dot rounds otherwise too, and one of more than `dot_rows.TILE_ROWS` (32) runs 32
  rows at a time (`by_row_tiles`: YNNPACK's float32 dot sums K in another order from 33 rows for
  K = 576). Its cost is over issue 29's 5% (engine/PERFORMANCE.md: the head's one-row product is 3x
  faster than two rows'; each tile reads the weight again), so it is not on by default: float32 is left
  alone;
- on a GPU with batch invariance on, a plain dot goes to the fixed-tile Pallas kernel of
  `invariant_matmul.py` (cuBLAS picks tiles and split-K by the number of rows);
- a quantized weight's convert is not fused into the dot by XLA CPU: a wide one (the LM head) is
  multiplied a chunk of columns at a time (`by_column_chunks`); a few rows (a batch-1 decode) by
  int8 or 4-bit codes with per-group scales go to a C++ op that widens each code in registers
  (`cpu_ops.quantized_matmul`), where it is built.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from xlaserve.kernels import cpu_dot, cpu_ops, dot_rows, invariant
from xlaserve.kernels.attention_args import SUPPORTED_DTYPES
from xlaserve.kernels.invariant_matmul import invariant_matmul


def is_16bit_float(dtype) -> bool:
    dtype = jnp.dtype(dtype)
    return dtype.itemsize == 2 and jnp.issubdtype(dtype, jnp.floating)


def is_8bit_float(dtype) -> bool:
    """float8_e4m3fn, float8_e5m2, ...: stored as uint8 words on CPU like 16-bit floats as uint16
    (XLA's CPU backend upcasts them for every gather, slice and scatter)."""
    dtype = jnp.dtype(dtype)
    return dtype.itemsize == 1 and jnp.issubdtype(dtype, jnp.floating)


def _word_of(dtype):
    if is_16bit_float(dtype):
        return jnp.dtype(jnp.uint16)
    if is_8bit_float(dtype):
        return jnp.dtype(jnp.uint8)
    return None


def as_words(x: jax.Array) -> jax.Array:
    """A 16-bit (8-bit) float array as uint16 (uint8) words (a bitcast, no copy); others as they are."""
    word = _word_of(x.dtype)
    return x if word is None else jax.lax.bitcast_convert_type(x, word)


def from_words(words: jax.Array, dtype) -> jax.Array:
    """The inverse of `as_words`: uint16 or uint8 words seen as `dtype`; anything else as it is."""
    if words.dtype != dtype and words.dtype == _word_of(dtype):
        return jax.lax.bitcast_convert_type(words, dtype)
    return words


def word_dtype(dtype):
    """The dtype an array of `dtype` is stored in by `as_words`."""
    return _word_of(dtype) or jnp.dtype(dtype)


def take_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """table[ids] along axis 0, gathered as raw words."""
    return from_words(as_words(table)[ids], table.dtype)


def matmul(
    x: jax.Array,
    w: jax.Array,
    out_dtype=None,
    scale: jax.Array | None = None,
    zero: jax.Array | None = None,
    block: tuple[int, int] | None = None,
    packed: bool = False,
) -> jax.Array:
    """x @ w accumulated in float32, returned in `out_dtype` (default: x's dtype).

    `scale`: `w` [.., in, out] is quantized (models/quantization.py: int8 or float8) and `scale` its
    float32 scales, one per block: [.., in / b_in, out / b_out]. One block along `in` ([.., 1, out]:
    per output channel, no `zero`): the scale multiplies the accumulator and the weight is only
    converted to x's dtype for the dot (on CPU: one 16-bit row by int8 in integers,
    `split_int8_matmul`; a wide weight by column chunks, `by_column_chunks`). Other blocks
    ([b_in, b_out] = `block`): the weight is dequantized first (still inside the step). `packed`:
    `w` holds 4-bit codes two to a byte ([.., in / 2, out] uint8, see `unpack_int4`), multiplied as
    two half-depth dots (`packed_matmul`)."""
    out_dtype = out_dtype or x.dtype
    if cpu_dot.is_packed(w):  # a bfloat16 weight packed at load for the CPU's invariant dot
        return cpu_dot.matmul(x, w, out_dtype)
    if cpu_ops.quantized_usable(x, w, scale, zero, block, packed):  # a few rows: one C++ op reads the codes
        return cpu_ops.quantized_matmul(x, w, scale, zero, packed).astype(out_dtype)
    if _split_int8_on_cpu(x, w, scale, zero):
        return split_int8_matmul(x, w, scale[..., 0, :]).astype(out_dtype)
    if _few_rows_on_cpu(x) and x.shape[-2] < (rows := _min_dot_rows(x, w, scale, packed)):
        padded = jnp.concatenate(
            [x, jnp.zeros((*x.shape[:-2], rows - x.shape[-2], x.shape[-1]), x.dtype)], -2
        )
        return _matmul_rows(padded, w, out_dtype, scale, zero, block, packed)[..., : x.shape[-2], :]
    if _many_float32_rows_on_cpu(x):
        return by_row_tiles(x, w, out_dtype, scale, zero, block, packed)
    return _matmul_rows(x, w, out_dtype, scale, zero, block, packed)


def _matmul_rows(x, w, out_dtype, scale, zero, block, packed) -> jax.Array:
    """`matmul` once its rows are settled."""
    if scale is not None and _wide_on_cpu(w, scale, zero):
        return by_column_chunks(x, w, out_dtype, scale, zero, block, packed)
    if packed:
        return packed_matmul(x, w, scale, zero, block).astype(out_dtype)
    if scale is None and _invariant_on_gpu(x, w):
        return invariant_matmul(x, w, out_dtype)
    if scale is None:
        return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(out_dtype)
    if scale.shape[-2] == 1 and zero is None and w.dtype == jnp.float8_e4m3fn and has_native_fp8():
        return fp8_matmul(x, w, scale[..., 0, :]).astype(out_dtype)
    if scale.shape[-2] == 1 and zero is None:
        y = jnp.matmul(x, convert_weight(w, x.dtype), preferred_element_type=jnp.float32)
        return (y * scale[..., 0, :]).astype(out_dtype)
    y = jnp.matmul(x, dequantize(w, scale, x.dtype, zero, block), preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


def convert_weight(w: jax.Array, dtype) -> jax.Array:
    """w.astype(dtype); on CPU a float8_e4m3fn weight to bfloat16 by integer ops on its bits (exact),
    which XLA CPU runs faster than its own float8 convert: a 30-layer scan of [576, 1536] fp8
    projections 1.19x -> 1.06x of bfloat16's at one row, 1.62x -> 1.22x at 8 (engine/QUANTIZATION.md)."""
    if w.dtype != jnp.float8_e4m3fn or jnp.dtype(dtype) != jnp.bfloat16 or jax.default_backend() != "cpu":
        return w.astype(dtype)
    u = jax.lax.bitcast_convert_type(w, jnp.uint8).astype(jnp.uint16)
    sign, exponent, mantissa = (u & 0x80) << 8, (u >> 3) & 0xF, u & 0x7
    # e4m3 (bias 7) -> bfloat16 (bias 127): the same 3 mantissa bits, shifted. No inf; e4m3's NaN
    # codes (0x7F, 0xFF) would read as 480: quantized weights are clipped to +-448, never NaN.
    normal = sign | ((exponent + 120) << 7) | (mantissa << 4)
    # A subnormal is mantissa * 2**-9: exact in float32, and its top 16 bits are its bfloat16.
    small = jax.lax.bitcast_convert_type(mantissa.astype(jnp.float32) * 2.0**-9, jnp.uint32) >> 16
    bits = jnp.where(exponent == 0, small.astype(jnp.uint16) | sign, normal)
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


def _invariant_on_gpu(x: jax.Array, w: jax.Array) -> bool:
    """On a GPU with batch invariance on, a plain dot goes to the fixed-tile Pallas kernel: cuBLAS and
    XLA's Triton GEMMs pick tiles and split-K by the number of rows (kernels/invariant_matmul.py)."""
    return (
        invariant.enabled()
        and jax.default_backend() == "gpu"
        and x.ndim >= 2
        and w.ndim == 2
        and jnp.dtype(x.dtype) == jnp.dtype(w.dtype)
        and jnp.dtype(x.dtype) in SUPPORTED_DTYPES
    )


# The fewest rows a padded dot has on CPU (the module docstring says why) whatever its shape: past every
# threshold measured. A plain dot's own, probed on this CPU, is often fewer (kernels/dot_rows.py).
MIN_DOT_ROWS = dot_rows.SAFE_ROWS


def _few_rows_on_cpu(x: jax.Array) -> bool:
    return (
        x.ndim >= 2
        and x.shape[-2] < dot_rows.reference_rows(x.dtype)
        and _pads_rows(x.dtype)
        and jax.default_backend() == "cpu"
    )


def _many_float32_rows_on_cpu(x: jax.Array) -> bool:
    return (
        x.ndim >= 2
        and x.shape[-2] > dot_rows.TILE_ROWS
        and jnp.dtype(x.dtype) == jnp.float32
        and invariant.covers_float32()
        and jax.default_backend() == "cpu"
    )


def by_row_tiles(x, w, out_dtype, scale, zero, block, packed) -> jax.Array:
    """`matmul` of x [.., M, K], `dot_rows.TILE_ROWS` rows at a time (a loop: XLA would fold a reshape
    back into one dot), the last tile padded with zeros: every dot has the tile's rows, so a row has
    the bits it has in a decode step's few (float32 with batch invariance on: its dot sums K in another
    order past some rows)."""
    tile, m = dot_rows.TILE_ROWS, x.shape[-2]
    num_tiles = -(-m // tile)
    if num_tiles * tile != m:
        x = jnp.concatenate([x, jnp.zeros((*x.shape[:-2], num_tiles * tile - m, x.shape[-1]), x.dtype)], -2)
    tiles = jnp.moveaxis(x.reshape(*x.shape[:-2], num_tiles, tile, x.shape[-1]), -3, 0)  # [n, .., tile, K]
    out = jax.lax.map(lambda t: _matmul_rows(t, w, out_dtype, scale, zero, block, packed), tiles)
    return jnp.moveaxis(out, 0, -3).reshape(*x.shape[:-2], num_tiles * tile, -1)[..., :m, :]


def _pads_rows(dtype) -> bool:
    """Whether a CPU dot of few rows of `dtype` is padded: 16-bit always (XLA's one-row 16-bit dot is slow,
    and with batch invariance on a few rows round otherwise); float32 only when its invariance is asked
    for (`invariant.covers_float32()`), where its one-row dot (a matrix-vector product, native and fast)
    rounds otherwise than the same row among others: a float32 request's logprob moved by an ulp with
    its companions."""
    dtype = jnp.dtype(dtype)
    return is_16bit_float(dtype) or (dtype == jnp.float32 and invariant.covers_float32())


def _min_dot_rows(x: jax.Array, w: jax.Array, scale, packed: bool) -> int:
    """The rows a dot of few rows is padded to: its shape's probed rows for a plain [M, K] x [K, N] dot of
    one dtype; the fixed bound for the rest (quantized, batched)."""
    if x.ndim == 2 and w.ndim == 2 and scale is None and not packed and w.dtype == x.dtype:
        return dot_rows.min_rows(x.shape[-1], w.shape[-1], x.dtype)
    return dot_rows.FAST_ROWS if not invariant.enabled() else MIN_DOT_ROWS


# int8 x int8 products summed in int32: |hi|, |lo|, |w| <= 128, so K < 2**31 / 128**2 = 131072 inputs
# can never overflow (SmolLM2's K: 576 and 1536; a 70B's down projection: 28672).
MAX_INT8_DOT_DEPTH = 2**31 // (128 * 128) - 1


# Rows of x up to which an int8 weight's dot runs as `split_int8_matmul` on CPU. It wins at one row
# (the batch-1 LM head 0.46-0.92x of bfloat16's, a projection 0.5-0.75x) and loses from 8 (XLA CPU's int8
# dot at 2M rows against the 16-bit one at M: engine/QUANTIZATION.md). Tests raise it to check the
# split's accuracy over a whole prompt.
INT8_SPLIT_MAX_ROWS = 1


def _split_int8_on_cpu(x: jax.Array, w: jax.Array, scale: jax.Array | None, zero: jax.Array | None) -> bool:
    return (
        x.ndim >= 2
        and x.shape[-2] <= INT8_SPLIT_MAX_ROWS
        and is_16bit_float(x.dtype)
        and jax.default_backend() == "cpu"
        and w.dtype == jnp.int8
        and scale is not None
        and zero is None
        and scale.shape[-2] == 1
        and w.shape[-2] <= MAX_INT8_DOT_DEPTH
    )


def split_int8_matmul(x: jax.Array, w: jax.Array, w_scale: jax.Array) -> jax.Array:
    """16-bit rows x [.., M, K] @ int8 w [.., K, N] with per-channel `w_scale` [.., N], as integers,
    without rounding x beyond its own precision -> float32 [.., M, N].

    x = s * (hi + lo / 256) with s a power of two per row (max |x| / s <= 127) and hi, lo int8: x / s
    is exact, hi its nearest integer, lo the remainder in 1/256ths. An element with |x| >= s / 2 has
    at most 8 significant bits above 2**-8 * s, so it is represented exactly; a smaller one is off by
    at most s / 256 (< 2**-14 * max |x|; bfloat16 rounds every element by 2**-9 of itself). The two
    row sets [hi; lo] make one int8 x int8 -> int32 dot (exact: `MAX_INT8_DOT_DEPTH`), which XLA CPU
    runs with VNNI: the batch-1 LM head 0.46-0.92x of the bfloat16 one in runs under load, where
    converting the int8 head to bfloat16 in the dot (not fused by XLA CPU) cost 3.4-5x
    (engine/QUANTIZATION.md)."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    s = jnp.exp2(jnp.ceil(jnp.log2(jnp.maximum(amax, jnp.finfo(jnp.float32).tiny) / 127.0)))
    v = x32 / s
    hi = jnp.floor(v + 0.5)
    lo = jnp.clip(jnp.floor((v - hi) * 256.0 + 0.5), -128, 127)
    m = x.shape[-2]
    rows = jnp.concatenate([hi, lo], axis=-2).astype(jnp.int8)  # [.., 2M, K]: one dot, not two
    acc = jnp.matmul(rows, w, preferred_element_type=jnp.int32).astype(jnp.float32)
    y = acc[..., :m, :] + acc[..., m:, :] * (1.0 / 256.0)
    return y * s * w_scale[..., None, :]


# Output columns per chunk of a wide quantized weight on CPU (the LM head): XLA CPU does not fuse the
# weight's convert (or dequantization) into the dot, so a [576, 49152] head was converted to a whole
# bfloat16 copy every step (56 MiB through memory: 2.2-10x the bfloat16 head's time); one chunk at a
# time stays in cache (0.8-1.4x, engine/QUANTIZATION.md).
COLUMN_CHUNK = 4096


def _wide_on_cpu(w: jax.Array, scale: jax.Array, zero: jax.Array | None) -> bool:
    return (
        jax.default_backend() == "cpu"
        and w.ndim == 2
        and w.shape[-1] >= 2 * COLUMN_CHUNK
        and scale.shape[-1] == w.shape[-1]  # one scale (and zero) per output column: sliced alike
    )


def by_column_chunks(x, w, out_dtype, scale, zero, block, packed) -> jax.Array:
    """`matmul` of a wide quantized [in, out] weight, COLUMN_CHUNK output columns at a time (a loop:
    one chunk's dequantized copy live at once); the columns past the last whole chunk in one more."""
    n = w.shape[-1] // COLUMN_CHUNK

    def part(start, size):
        def cols(a):
            return None if a is None else jax.lax.dynamic_slice_in_dim(a, start, size, axis=-1)

        return matmul(x, cols(w), jnp.float32, cols(scale), cols(zero), block, packed)

    def body(i, out):
        start = i * COLUMN_CHUNK
        return jax.lax.dynamic_update_slice_in_dim(out, part(start, COLUMN_CHUNK), start, axis=-1)

    out = jax.lax.fori_loop(0, n, body, jnp.zeros((*x.shape[:-1], w.shape[-1]), jnp.float32))
    if w.shape[-1] > n * COLUMN_CHUNK:
        tail = n * COLUMN_CHUNK
        out = out.at[..., tail:].set(part(tail, w.shape[-1] - tail))
    return out.astype(out_dtype)


def has_native_fp8() -> bool:
    """A device whose tensor cores multiply float8 (NVIDIA compute capability 8.9+: Ada, Hopper)."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return False
    try:
        return tuple(int(v) for v in str(device.compute_capability).split(".")) >= (8, 9)
    except (AttributeError, ValueError):
        return False


def fp8_matmul(x: jax.Array, w: jax.Array, w_scale: jax.Array) -> jax.Array:
    """[T, in] @ float8_e4m3fn [in, out] with the activations quantized per token on the fly
    (scale = max |x| of the row / 448), a float8 x float8 dot accumulated in float32, then both
    scales: vLLM's dynamic FP8 (W8A8). -> float32 [T, out]."""
    limit = float(jnp.finfo(jnp.float8_e4m3fn).max)
    x32 = x.astype(jnp.float32)
    x_scale = jnp.maximum(jnp.max(jnp.abs(x32), axis=-1, keepdims=True), 1e-12) / limit  # [T, 1]
    xq = jnp.clip(x32 / x_scale, -limit, limit).astype(jnp.float8_e4m3fn)
    y = jnp.matmul(xq, w, preferred_element_type=jnp.float32)
    return y * x_scale * w_scale


def dequantize(
    w: jax.Array, scale: jax.Array, dtype, zero: jax.Array | None = None, block: tuple[int, int] | None = None
) -> jax.Array:
    """A quantized [.., in, out] weight in `dtype`: w * scale (+ zero), `scale` and `zero` one per
    [b_in, b_out] `block` ([.., ceil(in / b_in), ceil(out / b_out)]), each repeated over its block.
    `block` None: as the shapes divide (exact when the blocks tile the weight)."""

    def expand(s):
        for axis, size in zip((-2, -1), block or (None, None)):
            s = jnp.repeat(s, size or -(-w.shape[axis] // s.shape[axis]), axis=axis)
        return s[..., : w.shape[-2], : w.shape[-1]]

    out = w.astype(jnp.float32) * expand(scale)
    return (out if zero is None else out + expand(zero)).astype(dtype)


def packed_matmul(x: jax.Array, w: jax.Array, scale: jax.Array, zero: jax.Array | None, block) -> jax.Array:
    """x [.., in] @ 4-bit codes `w` [in / 2, out] (uint8: input 2i in the low nibble, 2i + 1 in the
    high one) with `scale` and `zero` per [b_in, b_out] `block` -> float32 [.., out].

    Never interleaves the codes back into [in, out]: the low nibbles are the weights of the even
    inputs, the high ones of the odd inputs, each half dequantized (mask or shift, convert, scale per
    group of b_in / 2 rows) and multiplied by x's even or odd columns. On this CPU that is as fast as
    int8 codes; unpacking to [in, out] first (`unpack_int4`) is ~10x slower (engine/QUANTIZATION.md)."""
    half_block = (block[0] // 2, block[1])

    def half(codes, xs):
        weights = dequantize(codes, scale, x.dtype, zero, half_block)
        return jnp.matmul(xs, weights, preferred_element_type=jnp.float32)

    return half(w & 0x0F, x[..., 0::2]) + half(w >> 4, x[..., 1::2])


def unpack_int4(packed: jax.Array) -> jax.Array:
    """[.., in / 2, out] uint8 holding two 4-bit codes per byte (input 2i low, 2i + 1 high) ->
    [.., in, out] uint8 codes in [0, 16), for the callers that need the matrix itself (the embedding's
    gathered columns, MLA, experts); a matmul uses `packed_matmul`."""
    low, high = packed & 0x0F, packed >> 4
    both = jnp.stack([low, high], axis=-2)  # [.., in / 2, 2, out]
    return both.reshape(*packed.shape[:-2], packed.shape[-2] * 2, packed.shape[-1])


def einsum(spec: str, *operands: jax.Array) -> jax.Array:
    """jnp.einsum accumulated in float32, returned in the first operand's dtype."""
    return jnp.einsum(spec, *operands, preferred_element_type=jnp.float32).astype(operands[0].dtype)


def scan(body, init, xs, *, words_of=None, **kwargs):
    """`jax.lax.scan` whose 16-bit float `xs` (stacked layer weights) are sliced as raw words on
    CPU (elsewhere a plain scan: a GPU slices bfloat16 natively). Leaves already stored as uint16
    words (`stacks_as_words`) reach `body` as `words_of`, the model's 16-bit dtype. A packed stack
    (`cpu_dot.PackedWeight`) is not sliced: it rides the loop whole, and `body` gets it with the
    layer's index (`at`), which the CPU dot reads in place."""
    leaves, treedef = jax.tree.flatten(xs, is_leaf=cpu_dot.is_packed)
    packed = [a for a in leaves if cpu_dot.is_packed(a)]
    if packed:
        rest = [a for a in leaves if not cpu_dot.is_packed(a)]
        length = len(packed[0].strips)

        def body_in_place(carry, scanned):
            rest_of_layer, layer = scanned
            it = iter(rest_of_layer)
            layer_leaves = [a.at(layer) if cpu_dot.is_packed(a) else next(it) for a in leaves]
            return body(carry, jax.tree.unflatten(treedef, layer_leaves))

        return scan(
            body_in_place, init, (rest, jnp.arange(length, dtype=jnp.int32)), words_of=words_of, **kwargs
        )
    dtypes = jax.tree.map(lambda a: words_of if a.dtype == jnp.uint16 and words_of else a.dtype, xs)
    if jax.default_backend() == "cpu":
        xs = jax.tree.map(as_words, xs)

    def body_of_words(carry, xs_words):
        return body(carry, jax.tree.map(from_words, xs_words, dtypes))

    return jax.lax.scan(body_of_words, init, xs, **kwargs)


def stack_entry(xs, index, *, words_of=None):
    """Entry `index` (an int32 scalar, maybe traced) of stacked leaves `xs`, as `scan` hands its body
    one step's: read as raw words on CPU (16-bit floats back as their dtype, uint16 words as
    `words_of`), a packed stack at `index`, read in place. For a loop that reads several stacks at
    indices of its own (a hybrid model's pipeline stage, models/hybrid.py), without slicing them."""
    index = jnp.asarray(index, jnp.int32)

    def entry(a):
        if cpu_dot.is_packed(a):
            return a.at(index)
        dtype = words_of if a.dtype == jnp.uint16 and words_of else a.dtype
        words = as_words(a) if jax.default_backend() == "cpu" else a
        return from_words(jax.lax.dynamic_index_in_dim(words, index, 0, keepdims=False), dtype)

    return jax.tree.map(entry, xs, is_leaf=cpu_dot.is_packed)


def stacks_as_words(params, stack_names) -> object:
    """`params` with the 16-bit float leaves under `stack_names` (the stacked layers) stored as uint16
    words, so that the layer scan slices them without a copy of the whole stack per step (a bitcast
    of a whole array is a copy on XLA's CPU backend). Done once at load, on CPU only."""

    def convert(path, leaf):
        return as_words(leaf) if getattr(path[0], "key", None) in stack_names else leaf

    return jax.tree_util.tree_map_with_path(convert, params)
