"""A matmul whose rows keep their bits whatever the number of rows: one Pallas kernel, fixed tiles.

On a GPU, XLA sends a dot to cuBLAS or to its own Triton GEMMs, and both choose the tiling, the
split of the contraction (split-K) and the algorithm per shape: the same token multiplied alone or
among 63 others can be summed in another order and round differently (batch invariance, issue 29;
vLLM's batch-invariant mode replaces its GEMMs for the same reason). XLA's autotuning flags do not
help: with autotuning off cuBLAS's own heuristics still pick by shape. So on a GPU, with batch
invariance on, `dtype_ops.matmul` multiplies here instead.

Tiling: grid (row blocks, column blocks); a program owns a [block_m, block_n] tile of the output and
walks the contraction `block_k` at a time from 0 to K, adding each block's float32 dot to its
accumulator. The tiles are fixed by the weight's shape alone (never by M), so a row's value depends
on its own inputs and the weight: every M, every bucket, every companion gives the same bits. Edges
are masked loads (zeros add nothing to a sum), so K and N need not divide the tiles.

`interpret=True` runs the kernel on CPU (numerics, and the same invariance: the block dots have fixed
shapes); Triton lowering on GPU (`kernels/cuda_compile.py` compiles it for sm_90 on a machine without
one). `invariant_matmul_reference` is the spec: the same block order in jnp.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from xlaserve.kernels.attention_args import MIN_DOT_ROWS, SUPPORTED_DTYPES, check_power_of_2
from xlaserve.kernels.pallas_blocks import mma_precision


@dataclasses.dataclass(frozen=True)
class MatmulTiling:
    block_m: int  # output rows per program: fixed, so that a row's program never depends on M
    block_n: int  # output columns per program
    block_k: int  # contraction per loop step: fixes the order of the sum
    num_warps: int = 4
    num_stages: int = 3


DEFAULT_TILING = MatmulTiling(block_m=64, block_n=64, block_k=64)


def invariant_matmul(
    x: jax.Array,  # [..., M, K]
    w: jax.Array,  # [K, N]
    out_dtype=None,
    *,
    tiling: MatmulTiling = DEFAULT_TILING,
    interpret: bool = False,
) -> jax.Array:  # [..., M, N] in out_dtype (default: x's dtype)
    """x @ w accumulated in float32 over fixed `tiling.block_k` steps, in the same order for every
    row whatever M is. x and w share one of float32, bfloat16, float16."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    _validate(x, w, tiling)
    lead = x.shape[:-1]
    y = _invariant_matmul(
        x.reshape(-1, x.shape[-1]), w, out_dtype=out_dtype, tiling=tiling, interpret=interpret
    )
    return y.reshape(*lead, w.shape[1])


def invariant_matmul_reference(x: jax.Array, w: jax.Array, out_dtype=None, *, block_k: int = 64) -> jax.Array:
    """The spec in jnp: float32 partial dots over `block_k`-wide slices of K, added in order."""
    out_dtype = out_dtype or x.dtype
    acc = jnp.zeros((*x.shape[:-1], w.shape[1]), jnp.float32)
    for start in range(0, x.shape[-1], block_k):
        xs, ws = x[..., start : start + block_k], w[start : start + block_k]
        acc = acc + jnp.matmul(xs, ws, preferred_element_type=jnp.float32, precision=mma_precision(x.dtype))
    return acc.astype(out_dtype)


def _validate(x, w, tiling: MatmulTiling) -> None:
    if x.ndim < 2 or w.ndim != 2:
        raise ValueError(f"invariant_matmul takes x [..., M, K] and w [K, N], got {x.shape} and {w.shape}")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"x's contraction dim {x.shape[-1]} must equal w's rows {w.shape[0]}")
    dtype = jnp.dtype(x.dtype)
    if dtype not in SUPPORTED_DTYPES or jnp.dtype(w.dtype) != dtype:
        raise ValueError(f"x and w must share one of float32, bfloat16, float16; got {x.dtype} and {w.dtype}")
    for name in ("block_m", "block_n", "block_k"):
        check_power_of_2(name, getattr(tiling, name), minimum=MIN_DOT_ROWS)
    check_power_of_2("num_warps", tiling.num_warps, minimum=1)


@functools.partial(jax.jit, static_argnames=("out_dtype", "tiling", "interpret"))
def _invariant_matmul(x, w, *, out_dtype, tiling: MatmulTiling, interpret: bool):
    (m, k), n = x.shape, w.shape[1]
    kernel = functools.partial(_kernel, tiling=tiling, m=m, k=k, n=n)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(m, tiling.block_m), pl.cdiv(n, tiling.block_n)),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages),
        name="invariant_matmul",
    )(x, w)


def _kernel(x_ref, w_ref, o_ref, *, tiling: MatmulTiling, m: int, k: int, n: int):
    # x_ref [M, K], w_ref [K, N], o_ref [M, N]: whole arrays; this program reads its tiles by index.
    block_m, block_n, block_k = tiling.block_m, tiling.block_n, tiling.block_k
    rows = pl.program_id(0) * block_m + jax.lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)  # [bm, 1]
    cols = pl.program_id(1) * block_n + jax.lax.broadcasted_iota(jnp.int32, (1, block_n), 1)  # [1, bn]
    precision = mma_precision(x_ref.dtype)

    def step(i, acc):
        ks = i * block_k + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)  # [1, bk]
        x = plgpu.load(x_ref.at[rows, ks], mask=(rows < m) & (ks < k), other=0)  # [bm, bk]
        ks_col = ks.reshape(block_k, 1)
        w = plgpu.load(w_ref.at[ks_col, cols], mask=(ks_col < k) & (cols < n), other=0)  # [bk, bn]
        return acc + plgpu.dot(x, w, precision=precision)

    acc = jax.lax.fori_loop(0, pl.cdiv(k, block_k), step, jnp.zeros((block_m, block_n), jnp.float32))
    plgpu.store(o_ref.at[rows, cols], acc.astype(o_ref.dtype), mask=(rows < m) & (cols < n))
