"""Paged attention of single queries as a C++ XLA FFI handler on CPU (`kernels/cpu/paged_attention.cc`).

XLA's CPU backend cannot fuse a gather of pages into a dot, and the per-sequence dots of a decode
(9 query rows against a chunk of keys) are too small for its dot library: the jnp reference's
decode path took ~1.6 ms per layer at batch 64 on SmolLM2, a third of the step (engine/PERFORMANCE.md).
The handler reads every key and value row once from its page, in float32, one task per (query, KV
head) over XLA's intra-op thread pool, and is called from inside the jitted step like any op.

It is built from its source on first use with the system's C++ compiler (`CXX`, else `g++`) into
`<XLASERVE_CACHE_ROOT or ~/.cache/xlaserve>/cpu_kernels/<digest>/`, keyed by the source, the flags,
jaxlib's version and this CPU's instruction set (`-march=native`); several processes building at
once each write a temporary file and rename it. Where it cannot be built (no compiler) or is turned
off (`XLASERVE_CPU_KERNELS=0`), `available()` is False, the reason is logged once, and the reference
runs its jnp paths: the handler is an optimization of the reference backend, never a requirement.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

logger = logging.getLogger(__name__)

TARGET = "xlaserve_paged_attention"
SOURCE = Path(__file__).parent / "cpu" / "paged_attention.cc"
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC", "-w")
DISABLE_ENV = "XLASERVE_CPU_KERNELS"


def _cache_root() -> Path:
    """<XLASERVE_CACHE_ROOT or ~/.cache/xlaserve>/cpu_kernels: the root of engine/config.py's caches."""
    root = os.environ.get("XLASERVE_CACHE_ROOT") or Path.home() / ".cache" / "xlaserve"
    return Path(root) / "cpu_kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str) -> Path:
    include = jax.ffi.include_dir()
    digest = hashlib.sha256(
        "\0".join([SOURCE.read_text(), " ".join(FLAGS), compiler, jaxlib.__version__, _cpu_flags()]).encode()
    ).hexdigest()[:24]
    library = _cache_root() / digest / "libxlaserve_cpu.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    fd, partial = tempfile.mkstemp(dir=library.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        command = [compiler, *FLAGS, f"-I{include}", str(SOURCE), "-o", partial]
        subprocess.run(command, check=True, capture_output=True, text=True)
        os.replace(partial, library)  # atomic: another process sees the whole library or none
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    logger.info("Built the CPU attention op in %.1f s: %s", time.perf_counter() - start, library)
    return library


def available() -> bool:
    """Whether the handler serves this process: not turned off (`XLASERVE_CPU_KERNELS=0`, read at each
    trace), and built and registered with XLA (once)."""
    return os.environ.get(DISABLE_ENV, "1") != "0" and _registered()


@functools.cache
def _registered() -> bool:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        logger.warning("No C++ compiler (g++, or CXX): the CPU attention op is not built; jnp paths serve")
        return False
    try:
        library = ctypes.cdll.LoadLibrary(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        logger.warning("The CPU attention op did not build (%s); jnp paths serve", detail.strip()[-500:])
        return False
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.XlaservePagedAttention), platform="cpu")
    return True


def usable(cache: jax.Array, value_dtype) -> bool:
    """The handler serves this trace: a CPU default backend, a bfloat16 cache stored as uint16 words
    (the reference backend's on CPU), and the library available."""
    return (
        cache.dtype == jnp.uint16
        and jnp.dtype(value_dtype) == jnp.bfloat16
        and jax.default_backend() == "cpu"
        and available()
    )


def paged_attention(
    q_nhgd: jax.Array,  # [N, kv_heads, group, head_dim] float32, already scaled
    k_cache: jax.Array,  # [num_blocks, block_size, kv_heads, head_dim] uint16 words of bfloat16
    v_cache: jax.Array,  # same
    tables_np: jax.Array,  # [N, max_blocks] int32: each query's sequence's pages
    position_n: jax.Array,  # [N] int32: each query sees keys at positions <= its own
    active_n: jax.Array,  # [N] bool: inactive queries give zeros
    sliding_window: int | jax.Array | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # [N, kv_heads, group, head_dim] float32
    """Each query over its own table's pages, softmax in float32: the reference's `per_query`."""
    window = jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32).reshape(1)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q_nhgd.shape, jnp.float32))
    return call(
        q_nhgd.astype(jnp.float32),
        k_cache,
        v_cache,
        tables_np.astype(jnp.int32),
        position_n.astype(jnp.int32),
        active_n.astype(jnp.int32),
        window,
        soft_cap=np.float32(soft_cap or 0.0),
    )
