"""The compiled Pallas chunk kernels of the state models on a GPU (run by .ci/gpu-check; skipped on
CPU, where the interpret-mode tests in test_gated_delta.py and test_ssd.py check the same kernels):
the gated delta rule's (Qwen3.5 / Qwen3-Next: Q 64, Dk = Dv = 128, 16 value heads) and Mamba2's SSD
(Mamba2-130m: Q 64, P 64, N 128, 24 heads), each against its jnp reference run on the CPU device in
float32. Each prints its time against the reference's on the GPU (read in the check's log with -s):
what says whether 'auto' should take the kernel on a GPU."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.kernels import gated_delta, ssd
from xlaserve.kernels.gated_delta_pallas import delta_chunk_terms
from xlaserve.kernels.ssd_pallas import ssd_chunk_terms

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "gpu", reason="runs the compiled kernel: needs a CUDA GPU"
)


def _unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _gated_delta_args(num_chunks=8, q=64, heads=16, dk=128, dv=128, seed=0):
    rng = np.random.default_rng(seed)
    return [
        _unit(rng.normal(size=(num_chunks, q, heads, dk))) * dk**-0.5,
        _unit(rng.normal(size=(num_chunks, q, heads, dk))),
        rng.normal(size=(num_chunks, q, heads, dv)),
        -rng.uniform(0.01, 1.0, (num_chunks, q, heads)),
        rng.uniform(0.05, 0.95, (num_chunks, q, heads)),
    ]


def _ssd_args(num_chunks=8, q=64, heads=24, p=64, n=128, seed=1):
    rng = np.random.default_rng(seed)
    return [
        rng.normal(size=(num_chunks, q, heads, p)) * 0.1,
        np.cumsum(-rng.uniform(0.001, 0.1, (num_chunks, q, heads)), axis=1),
        rng.normal(size=(num_chunks, q, heads, n)),
        rng.normal(size=(num_chunks, q, heads, n)),
    ]


def _timed(fn, args, repeats=20):
    out = jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


def _check(name, kernel, reference, args, rtol):
    gpu_args = [jnp.asarray(a, jnp.float32) for a in args]
    cpu = jax.devices("cpu")[0]
    expected = jax.jit(reference, device=cpu)(*[jax.device_put(a, cpu) for a in gpu_args])
    compiled = jax.jit(kernel)
    for i, (ours, ref) in enumerate(zip(compiled(*gpu_args), expected, strict=True)):
        ours, ref = np.asarray(ours), np.asarray(ref)
        scale = np.abs(ref).max()
        err = np.abs(ours - ref).max() / scale
        assert err <= rtol, f"{name} output {i}: max error {err:.2e} of its largest value {scale:.2e}"
    kernel_s = _timed(compiled, gpu_args)
    reference_s = _timed(jax.jit(reference), gpu_args)
    print(
        f"\n{name} {tuple(args[0].shape)}: kernel {kernel_s * 1e6:.0f} us, jnp reference on the GPU "
        f"{reference_s * 1e6:.0f} us ({reference_s / kernel_s:.2f}x)"
    )


def test_gated_delta_chunk_kernel_on_gpu_matches_the_reference():
    _check(
        "gated delta chunk terms",
        delta_chunk_terms,
        gated_delta.chunk_terms_reference,
        _gated_delta_args(),
        rtol=1e-4,
    )


def test_ssd_chunk_kernel_on_gpu_matches_the_reference():
    # The kernel's dots run at the GPU's default float32 precision (TF32 tensor cores).
    _check("ssd chunk terms", ssd_chunk_terms, ssd.chunk_terms_reference, _ssd_args(), rtol=5e-3)
