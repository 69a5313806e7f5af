"""The batch-invariant matmul (kernels/invariant_matmul.py), the GPU's dot with batch invariance on:
its numerics against float64 (interpret mode), a row's bits whatever the number of rows, the step's
dots routed to it on a GPU only, its CUDA lowering and sm_90 compile, and the attention kernels'
fixed tiles under invariance."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.cuda_compile_run import compile_in_subprocess
from xlaserve.kernels import dtype_ops
from xlaserve.kernels.attention_args import Tiling
from xlaserve.kernels.invariant import batch_invariance
from xlaserve.kernels.invariant_matmul import (
    MatmulTiling,
    invariant_matmul,
    invariant_matmul_reference,
)

# K and N not multiples of the tiles: the masked edges are part of what is checked.
K, N = 200, 100
SMALL = MatmulTiling(block_m=16, block_n=32, block_k=32)


def _operands(dtype, m: int = 70, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, K)), dtype)
    w = jnp.asarray(rng.standard_normal((K, N)) / np.sqrt(K), dtype)
    return x, w


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matches_float64(dtype):
    x, w = _operands(dtype)
    y = invariant_matmul(x, w, jnp.float32, tiling=SMALL, interpret=True)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    # float32 accumulation of products that are exact (bfloat16 inputs) or nearly (float32).
    np.testing.assert_allclose(np.asarray(y), exact, rtol=0, atol=1e-5)
    ref = invariant_matmul_reference(x, w, jnp.float32, block_k=SMALL.block_k)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=0, atol=1e-5)


def test_a_rows_bits_do_not_depend_on_the_number_of_rows(tiling=SMALL):
    x, w = _operands("bfloat16")
    crowd = np.asarray(invariant_matmul(x, w, jnp.float32, tiling=tiling, interpret=True))
    for m in (1, 5, 17):  # one row, a few, past a row block
        alone = np.asarray(invariant_matmul(x[:m], w, jnp.float32, tiling=tiling, interpret=True))
        assert np.array_equal(alone, crowd[:m]), f"rows differ at M={m}"
    # a row among other companions, at another position: the same bits
    shuffled = np.asarray(invariant_matmul(x[::-1], w, jnp.float32, tiling=tiling, interpret=True))
    assert np.array_equal(shuffled[::-1], crowd)


def test_leading_dims_and_out_dtype():
    x, w = _operands("bfloat16", m=12)
    y = invariant_matmul(x.reshape(3, 4, K), w, tiling=SMALL, interpret=True)
    assert y.shape == (3, 4, N) and y.dtype == jnp.bfloat16
    flat = invariant_matmul(x, w, tiling=SMALL, interpret=True)
    assert np.array_equal(np.asarray(y.reshape(12, N), np.float32), np.asarray(flat, np.float32))


@pytest.mark.parametrize(
    "x_shape, w_shape, dtypes, tiling, message",
    [
        ((4, 8), (9, 3), ("float32", "float32"), SMALL, "contraction dim 8 must equal w's rows 9"),
        ((8,), (8, 3), ("float32", "float32"), SMALL, r"x \[..., M, K\] and w \[K, N\]"),
        ((4, 8), (8, 3), ("bfloat16", "float32"), SMALL, "must share one of"),
        ((4, 8), (8, 3), ("int32", "int32"), SMALL, "must share one of"),
        ((4, 8), (8, 3), ("float32", "float32"), MatmulTiling(16, 24, 16), "block_n"),
        ((4, 8), (8, 3), ("float32", "float32"), MatmulTiling(8, 16, 16), "block_m"),
    ],
)
def test_bad_arguments_are_named(x_shape, w_shape, dtypes, tiling, message):
    x, w = jnp.zeros(x_shape, dtypes[0]), jnp.zeros(w_shape, dtypes[1])
    with pytest.raises(ValueError, match=message):
        invariant_matmul(x, w, tiling=tiling, interpret=True)


def _lowered_for_cuda(on: bool, monkeypatch) -> str:
    """dtype_ops.matmul's trace as a GPU would make it (the backend check answers 'gpu')."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    x = jax.ShapeDtypeStruct((8, 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
    with batch_invariance(on):
        traced = jax.jit(lambda a, b: dtype_ops.matmul(a, b)).trace(x, w)
    return traced.lower(lowering_platforms=("cuda",)).as_text()


def test_the_steps_dots_take_the_kernel_on_a_gpu_with_invariance_on(monkeypatch):
    on, off = _lowered_for_cuda(True, monkeypatch), _lowered_for_cuda(False, monkeypatch)
    assert re.findall(r"stablehlo.custom_call @([\w$.]+)", on) == ["__gpu$xla.gpu.triton"]
    assert "custom_call" not in off and "stablehlo.dot_general" in off
    # and never on CPU, where YNNPACK's dots keep a row's bits from 16 rows on (kernels/dtype_ops.py)
    monkeypatch.undo()
    x, w = _operands("bfloat16", m=8)
    with batch_invariance(True):
        text = jax.jit(dtype_ops.matmul).lower(x, w).as_text()
    assert "custom_call" not in text


def test_attention_tiles_are_fixed_with_invariance_on():
    """A decode-sized step (T <= R) gets 16-row programs only with invariance off: a tile's shape
    picks the tensor-core instruction, so a token decoded and the same token in a prefill chunk must
    share it."""
    with batch_invariance(False):
        assert Tiling.resolve(8, 8, 4).block_q * 4 == 16
        assert Tiling.resolve(64, 8, 4).block_q * 4 == 64
    with batch_invariance(True):
        assert Tiling.resolve(8, 8, 4).block_q * 4 == 64
        assert Tiling.resolve(64, 8, 4).block_q * 4 == 64


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="runs the compiled kernel: needs a CUDA GPU")
def test_compiled_on_gpu_is_invariant_and_matches_reference():
    x, w = _operands("bfloat16", m=130)
    crowd = np.asarray(invariant_matmul(x, w, jnp.float32))
    ref = invariant_matmul_reference(x, w, jnp.float32)
    np.testing.assert_allclose(crowd, np.asarray(ref), rtol=0, atol=1e-4)
    for m in (1, 7, 64):
        assert np.array_equal(np.asarray(invariant_matmul(x[:m], w, jnp.float32)), crowd[:m])


def test_compiles_to_sm90_cubin():
    """Triton's compiler and ptxas take the lowered kernel to a cubin (Llama-3.2-1B's LM head)."""
    out = compile_in_subprocess("matmul", "lm head")
    assert out.count("ok   matmul sm_90") == 1, out
