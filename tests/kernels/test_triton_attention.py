"""What is specific to the Triton ragged paged attention kernel: its sm_90 compile, and its launch
through jax-triton against the float64 oracle, which needs a GPU. Its numerics under Triton's
interpreter (CPU, torch tensors) are test_attention_contract.py's, with every other backend's.

Nothing here imports triton at module level: Triton decides once per process, when first imported,
whether `triton.jit` compiles or interprets, and the contract suite turns the interpreter on first.
"""

from __future__ import annotations

from functools import cache, partial

import jax
import numpy as np
import pytest

from helpers.attention_cases import BATCHES, KERNEL_CONFIGS, case_seed, run_case, tolerance
from helpers.cuda_compile_run import compile_in_subprocess

requires_gpu = pytest.mark.skipif(
    jax.default_backend() != "gpu",
    reason="launching through jax-triton needs a CUDA GPU (and the cuda extra)",
)


def test_compiles_to_sm90_cubin():
    """The compiled (not interpreted) kernel goes through Triton's whole pipeline to an sm_90 cubin."""
    out = compile_in_subprocess("triton", "decode", "window + cap", "sinks")
    assert out.count("ok   triton sm_90") == 3, out


@cache
def _jax_triton_op():
    """One object: one jitted step per shape."""
    pytest.importorskip("triton", reason="the Triton kernel needs `pip install triton` (the test extra)")
    from xlaserve.kernels import triton_attention

    return partial(triton_attention.ragged_paged_attention)


@requires_gpu
@pytest.mark.parametrize("config", ["gqa2", "gqa8_window", "gqa2_window_cap", "bfloat16", "gqa3"])
def test_jax_triton_launch_matches_float64_reference(config):
    cfg = KERNEL_CONFIGS[config]
    op = _jax_triton_op()
    for batch in ("decode", "mixed"):
        out, expected, _, _, info = run_case(
            cfg, BATCHES[batch](cfg.layout.block_size), case_seed("jax-triton", config, batch), attention=op
        )
        n = info["num_real_tokens"]
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out[:n], expected[:n], **tolerance(cfg.dtype))
        np.testing.assert_array_equal(out[n:], 0.0)
