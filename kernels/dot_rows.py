"""How few rows a 16-bit or float32 dot may run with on CPU: probed per shape and dtype on this machine, once.

XLA's CPU backend (YNNPACK for 16-bit dots with float32 accumulation) picks a dot's kernel, and so the
order a row's products are summed in, from the number of rows M. From some M on every dot of a shape
shares one order; below it a row rounds otherwise (a matrix-vector kernel for one row; others for a
few). `dtype_ops.matmul` pads a dot of fewer rows up to that M, so a token's projections have the same
bits alone as among companions (batch invariance, kernels/invariant.py). The M depends on the CPU, the
shape and the dtype: for bfloat16, 3 for SmolLM2's shapes and up to 11 for a [M, 12] x [12, 48] dot on
an AMX Xeon, 2 for every shape on an AVX512-BF16 EPYC; for float32 (padded with batch invariance on
only: its one-row dot is native), 2 for every shape on that EPYC. Padding to the largest seen (16) is
always safe and costs time: SmolLM2's 30 layers at 16 rows took 23 ms against 14.7 ms at 2 on the EPYC
(engine/PERFORMANCE.md).

So an engine on one CPU device asks for the shape's own M (`probing(True)` around its trace): the
probe compiles one program holding the dot at 1..15 rows and at `SAFE_ROWS` (float32: 1..31 and
`TILE_ROWS`, since a float32 dot runs at every count up to its tile), for the weight as stored ([K, N])
and as a transpose ([N, K].T: a tied LM head), and takes the fewest rows from which every row equals its
`SAFE_ROWS` (`TILE_ROWS`) bits in both. The answer is kept per machine (jaxlib, CPU flags, XLA_FLAGS) in
`<XLASERVE_CACHE_ROOT or ~/.cache/xlaserve>/dot_rows.json`: about a second per shape, once. Elsewhere
(several devices, whose local shapes are not the traced ones; a GPU; batch invariance off, where only
speed matters) the rows are the fixed ones below.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from xlaserve.kernels import invariant
from xlaserve.kernels.cpu_ops import cache_root, cpu_flags

logger = logging.getLogger(__name__)

SAFE_ROWS = 16  # every CPU measured keeps a row's bits from here on, in every shape
# float32 dots (batch invariance on) run in tiles of at most this many rows: YNNPACK's float32 dot sums
# K in another order from 33 rows on for K = 576 (SmolLM2's projections and LM head; from 51 for
# [M, 576] x [576, 96] again) on an AVX512-BF16 EPYC, so a row among 40 companions rounded otherwise than
# among 8. Its probe checks every count of rows up to here.
TILE_ROWS = 32
FAST_ROWS = 2  # off XLA CPU's one-row matrix-vector path, which is not native (batch invariance off)

_PROBING = contextvars.ContextVar("xlaserve_dot_rows_probing", default=False)


@contextlib.contextmanager
def probing(on: bool) -> Iterator[None]:
    """Trace what runs inside with each shape's probed rows (on) or `SAFE_ROWS` (off)."""
    token = _PROBING.set(bool(on))
    try:
        yield
    finally:
        _PROBING.reset(token)


def traced_probing(on: bool, fn: Callable) -> Callable:
    """`fn` whose body (so its trace, under `jax.jit`) runs inside `probing(on)`."""
    return invariant.traced_in(probing, on, fn)


def reference_rows(dtype) -> int:
    """The rows a probe of `dtype` compares fewer rows with: float32's tile, 16-bit's `SAFE_ROWS`."""
    return TILE_ROWS if jnp.dtype(dtype) == jnp.float32 else SAFE_ROWS


def min_rows(k: int, n: int, dtype) -> int:
    """The rows a [M, k] x [k, n] dot of `dtype` (16-bit, or float32 with its batch invariance asked for:
    see `dtype_ops.matmul`) is padded to on CPU when M is fewer."""
    if not invariant.enabled():
        return FAST_ROWS
    if not _PROBING.get():
        return SAFE_ROWS
    return _probed(int(k), int(n), jnp.dtype(dtype).name)


_lock = threading.Lock()  # warm-up traces programs on a pool of threads
_memo: dict[tuple[int, int, str], int] = {}


def _probed(k: int, n: int, dtype: str) -> int:
    with _lock:
        if (k, n, dtype) not in _memo:
            key = f"{k}x{n}:{dtype}"
            store = _read_store()
            if key not in store:
                start = time.perf_counter()
                store[key] = probe(k, n, dtype)
                logger.info(
                    "%s dots [M, %d] x [%d, %d] keep a row's bits from M = %d on this CPU (probed in %.1fs)",
                    dtype,
                    k,
                    k,
                    n,
                    store[key],
                    time.perf_counter() - start,
                )
                _write_store(key, store[key])
            _memo[(k, n, dtype)] = store[key]
        return _memo[(k, n, dtype)]


def probe(k: int, n: int, dtype: str) -> int:
    """The fewest rows (up to `reference_rows`: R) from which a [M, k] x [k, n] dot gives every row the
    bits it has among R rows, for the weight stored as [k, n] and as [n, k] read transposed. Runs now,
    even while a program is being traced."""
    reference = reference_rows(dtype)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((reference, k), np.float32)
    w = rng.standard_normal((k, n), np.float32) / np.sqrt(k)
    with jax.ensure_compile_time_eval(), jax.default_device(jax.devices("cpu")[0]):
        same = np.asarray(_same_rows(jnp.asarray(x, dtype), jnp.asarray(w, dtype), jnp.asarray(w.T, dtype)))
    rows = reference
    while rows > 1 and same[rows - 2]:  # same[m - 1]: m rows agree
        rows -= 1
    return rows


def _same_rows_of(x: jax.Array, w: jax.Array, w_t: jax.Array) -> jax.Array:
    """[R - 1] bool (x: [R, k]): whether the dot of x's first m rows (m = 1..) has the full dot's bits."""

    def dot(rows, weight):
        return jnp.matmul(rows, weight, preferred_element_type=jnp.float32)

    full, full_t = dot(x, w), dot(x, w_t.T)
    return jnp.stack(
        [
            jnp.all(dot(x[:m], w) == full[:m]) & jnp.all(dot(x[:m], w_t.T) == full_t[:m])
            for m in range(1, x.shape[0])
        ]
    )


# Compiled at XLA's backend optimization level 0: YNNPACK picks a dot's kernel from its shape when it
# runs, so the answers are the same as at the default level (checked for SmolLM2's shapes), and the
# probe compiles in 0.35 s instead of 0.6.
_same_rows = jax.jit(_same_rows_of, compiler_options={"xla_backend_optimization_level": 0})


def _store_path() -> Path:
    return cache_root() / "dot_rows.json"


def _machine() -> str:
    """What the answers hold for: this jaxlib, this CPU's instruction set, these XLA flags."""
    key = "\0".join([jaxlib.__version__, cpu_flags(), os.environ.get("XLA_FLAGS", "")])
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def _read_store() -> dict[str, int]:
    try:
        return json.loads(_store_path().read_text()).get(_machine(), {})
    except (OSError, ValueError, AttributeError):
        return {}


def _write_store(key: str, rows: int) -> None:
    """Add one answer (a temporary file renamed over the store: processes writing at once each leave a
    whole file; an answer lost to a race is probed again)."""
    path = _store_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            everything = json.loads(path.read_text())
        except (OSError, ValueError):
            everything = {}
        everything.setdefault(_machine(), {})[key] = rows
        fd, partial = tempfile.mkstemp(dir=path.parent, suffix=".json.tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(everything, f)
        os.replace(partial, path)
    except OSError as e:  # a read-only cache: probe again next time
        logger.debug("dot rows not stored: %s", e)
