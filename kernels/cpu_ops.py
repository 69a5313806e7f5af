"""C++ XLA FFI ops for CPU, where XLA's own code generation is the bottleneck (`kernels/cpu/*.cc`).

- `paged_attention`: paged attention of single queries (the reference backend's decode, few and
  short paths on a bfloat16 or a float32 cache: one handler each). XLA's CPU backend cannot fuse a
  gather of pages into a dot, and a decode's per-sequence dots (9 query rows against a chunk of keys)
  are too small for its dot library: the jnp path took ~1.6 ms per layer at batch 64 on SmolLM2, a
  third of the step. The op reads every key and value row once from its page, in float32, one task
  per query. Its programs are also far smaller: a float32 engine's step compiled in about half the
  time of the jnp paths' (tiny models, where compiling is most of the work: tests).
- `quantized_matmul`: a few rows (a batch-1 decode) times a weight quantized with group scales
  (GGUF's Q8_0, Q4_0, Q4_1, the K-quants as decoded; int8 per channel). XLA converts such a weight to
  a bfloat16 copy before its dot, never fused; the op widens each code in registers.
- `bf16_matmul`: x [M, K] bfloat16 times a bfloat16 weight packed at load into strips of 64 columns
  (`pack_for_dot`; kernels/cpu_dot.py holds them), for every M: each output's sum is one chain of
  vdpbf16ps over K in order (a float32 loop without AVX512-BF16), whatever the rows, tiles or
  threads, so a row has the same bits alone or among companions with no padded rows. It reads its
  layer in place from the whole stack (the index an operand): the layer scan copied every slice,
  and XLA's dot library packed it again. SmolLM2's batch-1 step went from ~26 to ~11 ms
  (engine/PERFORMANCE.md, "A batch-invariant bfloat16 dot").

All run from inside the jitted step like any op, their work spread over XLA's intra-op thread pool.
Each is built from its source when first needed with the system's C++ compiler (`CXX`, else `g++`;
~2-3 s each) into `<XLASERVE_CACHE_ROOT or ~/.cache/xlaserve>/cpu_kernels/<digest>/`,
keyed by the source, the flags, jaxlib's version and this CPU's instruction set (`-march=native`);
processes building at once each write a temporary file and rename it. Where they cannot be built
(no compiler) or are turned off (`XLASERVE_CPU_KERNELS=0`), `available()` is False, the reason is
logged once, and the callers run their jnp forms: an optimization, never a requirement. GPUs never
use them.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

logger = logging.getLogger(__name__)

# The attention op's names in a compiled program, one per cache dtype (neither a prefix of the other:
# `targets_called_by` finds them by name).
TARGET = "xlaserve_paged_attention_bf16"  # a bfloat16 cache, stored as uint16 words
F32_TARGET = "xlaserve_paged_attention_f32"  # a float32 cache
QUANTIZED_TARGET = "xlaserve_quantized_matmul"
BF16_MATMUL_TARGET = "xlaserve_bf16_matmul"
# Target name -> (source in kernels/cpu, the handler's symbol, the compiler's defines for its build).
_OPS = {
    TARGET: ("paged_attention.cc", "XlaservePagedAttention", ()),
    F32_TARGET: ("paged_attention.cc", "XlaservePagedAttentionF32", ("-DXLASERVE_F32_CACHE",)),
    QUANTIZED_TARGET: ("quantized_matmul.cc", "XlaserveQuantizedMatmul", ()),
    # Its portable loop's float32 sums in source order: no fused multiply-adds chosen by the compiler.
    BF16_MATMUL_TARGET: ("bf16_matmul.cc", "XlaserveBf16Matmul", ("-ffp-contract=off",)),
}
SOURCE_DIR = Path(__file__).parent / "cpu"
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC", "-w")
DISABLE_ENV = "XLASERVE_CPU_KERNELS"
MAX_MATMUL_ROWS = 8  # kMaxRows of quantized_matmul.cc
# Rows up to which `quantized_matmul` beats XLA's convert-then-dot, measured here: 4-bit codes (their
# unpacking costs XLA most) to 8; int8 codes to 2 (at 4 rows XLA's dot library pulls ahead).
MAX_ROWS_PACKED, MAX_ROWS_INT8 = 8, 2


def cache_root() -> Path:
    """<XLASERVE_CACHE_ROOT or ~/.cache/xlaserve>: the root of engine/config.py's caches, where the
    kernels keep what they build or probe on this machine."""
    return Path(os.environ.get("XLASERVE_CACHE_ROOT") or Path.home() / ".cache" / "xlaserve")


def _cache_root() -> Path:
    return cache_root() / "cpu_kernels"


def cpu_flags() -> str:
    """This CPU's instruction set (/proc/cpuinfo's flags line): what a build or a probe here holds for."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str, target: str) -> Path:
    """`target`'s library, compiled unless this source, flags, compiler, jaxlib and CPU built it before."""
    source, _, defines = _OPS[target]
    source = SOURCE_DIR / source
    texts = [source.read_text(), *(h.read_text() for h in sorted(SOURCE_DIR.glob("*.h")))]
    key = "\0".join([*texts, " ".join(FLAGS + defines), compiler, jaxlib.__version__, cpu_flags()])
    library = _cache_root() / hashlib.sha256(key.encode()).hexdigest()[:24] / f"lib{source.stem}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    fd, partial = tempfile.mkstemp(dir=library.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        command = [compiler, *FLAGS, *defines, f"-I{jax.ffi.include_dir()}", str(source), "-o", partial]
        subprocess.run(command, check=True, capture_output=True, text=True)
        os.replace(partial, library)  # atomic: another process sees the whole library or none
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    logger.info("Built the CPU op %s in %.1f s: %s", target, time.perf_counter() - start, library)
    return library


def available(target: str = TARGET) -> bool:
    """Whether op `target` serves this process: not turned off (`XLASERVE_CPU_KERNELS=0`, read at each
    trace), and built and registered with XLA (once; waits for `prepare_in_background`'s build). Each
    op is built only when first needed (a bfloat16 model never builds the quantized matmul)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return False
    with _REGISTER_LOCK:
        lock = _LOCKS.setdefault(target, threading.Lock())
    with lock:
        return _register_once(target)


def prepare_in_background(*targets: str) -> None:
    """Build and register `targets`, each on its own thread: a cold start's compiler runs (2-6 s each
    here) then overlap the weights' loading and each other instead of delaying the first trace."""
    if os.environ.get(DISABLE_ENV, "1") != "0":
        for target in targets:
            threading.Thread(target=available, args=(target,), name=f"xlaserve-{target}", daemon=True).start()


def targets_called_by(serialized: bytes) -> list[str]:
    """The ops of this module a serialized executable calls (their names are in its bytes): a stored
    program must find them registered before it is loaded."""
    return [target for target in _OPS if target.encode() in serialized]


_LOCKS: dict[str, threading.Lock] = {}  # one per op: one op's build never waits for another's
_REGISTER_LOCK = threading.Lock()


@functools.cache
def _register_once(target: str) -> bool:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        logger.warning("No C++ compiler (g++, or CXX): the CPU op %s is not built; jnp forms serve", target)
        return False
    try:
        library = ctypes.cdll.LoadLibrary(str(_build(compiler, target)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        logger.warning("The CPU op %s did not build (%s); jnp forms serve", target, detail.strip()[-500:])
        return False
    handler = getattr(library, _OPS[target][1])
    with _REGISTER_LOCK:
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    logger.info("CPU op %s registered", target)
    return True


def attention_target(value_dtype) -> str | None:
    """The attention op's handler for a cache of `value_dtype` (bfloat16, held as uint16 words by the
    reference backend, or float32), or None: the jnp paths serve it."""
    return {jnp.dtype(jnp.bfloat16): TARGET, jnp.dtype(jnp.float32): F32_TARGET}.get(jnp.dtype(value_dtype))


def usable(cache: jax.Array, value_dtype) -> bool:
    """The handler serves this trace: a CPU default backend, a cache the op reads (bfloat16 words or
    float32: `attention_target`) and its library available."""
    target = attention_target(value_dtype)
    stored = jnp.uint16 if target == TARGET else jnp.float32
    on_cpu = jax.default_backend() == "cpu"
    return on_cpu and target is not None and cache.dtype == stored and available(target)


def paged_attention(
    q_nhgd: jax.Array,  # [N, kv_heads, group, head_dim] float32, already scaled
    k_cache: jax.Array,  # [num_blocks, block_size, kv_heads, head_dim] uint16 words of bfloat16, or float32
    v_cache: jax.Array,  # same
    tables_np: jax.Array,  # [N, max_blocks] int32: each query's sequence's pages
    position_n: jax.Array,  # [N] int32: each query sees keys at positions <= its own
    active_n: jax.Array,  # [N] bool: inactive queries give zeros
    sliding_window: int | jax.Array | None = None,
    soft_cap: float | None = None,
    sinks_hg: jax.Array | None = None,  # [kv_heads, group] float32: each query head's sink logit
) -> jax.Array:  # [N, kv_heads, group, head_dim] float32
    """Each query over its own table's pages, softmax in float32: the reference's `per_query`."""
    window = jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32).reshape(1)
    sinks = jnp.zeros((1,), jnp.float32) if sinks_hg is None else sinks_hg.astype(jnp.float32).reshape(-1)
    target = F32_TARGET if k_cache.dtype == jnp.float32 else TARGET  # uint16: bfloat16's words
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q_nhgd.shape, jnp.float32))
    return call(
        q_nhgd.astype(jnp.float32),
        k_cache,
        v_cache,
        tables_np.astype(jnp.int32),
        position_n.astype(jnp.int32),
        active_n.astype(jnp.int32),
        window,
        sinks,
        soft_cap=np.float32(soft_cap or 0.0),
        has_sinks=sinks_hg is not None,
    )


def quantized_usable(x: jax.Array, w: jax.Array, scale, zero, block, packed: bool) -> bool:
    """`quantized_matmul` serves x @ w: CPU, a few rows (MAX_ROWS_*), a 2-D weight of int8 codes (or
    4-bit codes packed in uint8) with one scale (and zero) per group of inputs of each column."""
    if jax.default_backend() != "cpu" or scale is None or w.ndim != 2 or scale.ndim != 2:
        return False
    rows = math.prod(x.shape[:-1])
    depth, columns = x.shape[-1], w.shape[-1]
    groups = scale.shape[0]
    return (
        1 <= rows <= (MAX_ROWS_PACKED if packed else MAX_ROWS_INT8)
        and (w.dtype == jnp.uint8 if packed else w.dtype == jnp.int8)
        and w.shape[0] * (2 if packed else 1) == depth
        and scale.shape[1] == columns
        and (block is None or block[1] == 1)
        and columns % 16 == 0
        and depth % groups == 0
        and (not packed or (depth // groups) % 2 == 0)
        and (zero is None or zero.shape == scale.shape)
        and available(QUANTIZED_TARGET)
    )


def quantized_matmul(
    x: jax.Array,  # [..., K]: at most MAX_MATMUL_ROWS rows
    w: jax.Array,  # [K, N] int8 codes, or [K / 2, N] uint8 holding two 4-bit codes (input 2i low)
    scale: jax.Array,  # [G, N]: each group of K / G inputs of a column; float16 or float32
    zero: jax.Array | None = None,  # [G, N]: w = scale * code + zero (GGUF's formats with mins)
    packed: bool = False,
) -> jax.Array:  # [..., N] float32
    """x @ (scale * codes + zero), each group's codes times x summed in float32, then scaled."""
    depth, columns = x.shape[-1], w.shape[-1]
    rows = math.prod(x.shape[:-1])

    def as_scale(a):
        return a if a.dtype in (jnp.float16, jnp.float32) else a.astype(jnp.float32)

    call = jax.ffi.ffi_call(QUANTIZED_TARGET, jax.ShapeDtypeStruct((rows, columns), jnp.float32))
    y = call(
        x.reshape(rows, depth).astype(jnp.float32),
        w,
        as_scale(scale),
        as_scale(zero) if zero is not None else jnp.zeros((1,), jnp.float32),
        packed=packed,
        has_zero=zero is not None,
    )
    return y.reshape(*x.shape[:-1], columns)


STRIP = 64  # columns per strip of a packed weight (kStrip of bf16_matmul.cc)


def pack_for_dot(w: jax.Array | np.ndarray) -> jax.Array | np.ndarray:
    """A bfloat16 weight [..., K, N] (or its uint16 words) as `bf16_matmul` reads it: strips of 64
    columns, each contiguous, inputs in pairs: [..., S, K' / 2, 64, 2] uint16 words with
    out[.., s, k, c, t] = w[.., 2k + t, 64 s + c]; K and N padded with zeros to K' even and S * 64.
    A numpy array is packed on the host (nothing compiles)."""
    xp = np if isinstance(w, np.ndarray) else jnp
    if w.dtype != np.uint16:
        w = w.astype(jnp.bfloat16)
        w = w.view(np.uint16) if xp is np else jax.lax.bitcast_convert_type(w, jnp.uint16)
    *lead, depth, columns = w.shape
    strips = -(-columns // STRIP)
    pad = [(0, 0)] * len(lead) + [(0, depth % 2), (0, strips * STRIP - columns)]
    words = xp.pad(w, pad).reshape(*lead, (depth + 1) // 2, 2, strips, STRIP)
    n = len(lead)
    return xp.transpose(words, (*range(n), n + 2, n, n + 3, n + 1))


def bf16_matmul(
    x: jax.Array,  # [M, K] bfloat16
    strips: jax.Array,  # [L, S, K' / 2, 64, 2] uint16: a stack of packed weights (`pack_for_dot`)
    layer: jax.Array | int,  # which of the L
    columns: int,  # N: the weight's columns before padding
) -> jax.Array:  # [M, N] float32
    """x @ w[layer], each output's sum over K in an order fixed by K alone (batch invariant at every
    M), the weight read in place from its stack."""
    depth = strips.shape[-3] * 2
    if x.shape[-1] != depth:  # an odd K, padded: zeros add exactly
        x = jnp.pad(x, [(0, 0), (0, depth - x.shape[-1])])
    out = jax.ShapeDtypeStruct((x.shape[0], strips.shape[1] * STRIP), jnp.float32)
    y = jax.ffi.ffi_call(BF16_MATMUL_TARGET, out)(x, strips, jnp.asarray(layer, jnp.int32).reshape(1))
    return y if y.shape[-1] == columns else y[:, :columns]
