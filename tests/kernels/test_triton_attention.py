"""The Triton ragged paged attention kernel under Triton's interpreter (CPU, torch tensors) against the
float64 oracle; its sm_90 compile; and its launch through jax-triton, which needs a GPU.

Outputs start as NaN (poisoned) before each launch: every real token's row must be written, and the
rows of padding tokens must be left alone (the JAX wrapper zeroes them).

Triton decides once per process, when first imported, whether `triton.jit` compiles or interprets
(TRITON_INTERPRET). Without a GPU this module turns the interpreter on before importing it; on a
GPU it leaves Triton compiling, so the jax-triton launch runs and the interpreter tests skip.
"""

from __future__ import annotations

import os
import sys
from functools import partial

import jax
import numpy as np
import pytest

from helpers.attention_cases import BATCHES, CONFIGS, AttnConfig, build_case, case_seed, run_case, tolerance

ON_GPU = jax.default_backend() == "gpu"
if not ON_GPU:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(
            "triton was imported in compile mode before this module could set TRITON_INTERPRET=1; "
            "run this file on its own (python -m pytest tests/test_triton_attention.py)",
            allow_module_level=True,
        )
    os.environ["TRITON_INTERPRET"] = "1"
torch = pytest.importorskip("torch")
triton = pytest.importorskip(
    "triton", reason="the Triton interpreter needs `pip install triton` (the test extra)"
)

from xlaserve.kernels import triton_attention  # noqa: E402 (after TRITON_INTERPRET is set)
from xlaserve.kernels.attention_args import Tiling  # noqa: E402

TRITON_CONFIGS = {**CONFIGS, "gqa3": AttnConfig(6, 2)}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
requires_gpu = pytest.mark.skipif(
    not ON_GPU, reason="launching through jax-triton needs a CUDA GPU (and the cuda12 extra)"
)
interpreter = pytest.mark.skipif(
    ON_GPU, reason="on a GPU Triton compiles; the jax-triton launch tests check numerics"
)


def run_interpreted(cfg: AttnConfig, seqs, seed: int, **case_kw) -> tuple[np.ndarray, np.ndarray, int]:
    """-> (out, expected, number of real tokens); out as float64, NaN where the kernel wrote nothing."""
    case = build_case(cfg, seqs, seed, **case_kw)
    k_cache, v_cache = case.written_caches()
    dtype = TORCH_DTYPES[cfg.dtype]

    def ints(x):
        return torch.tensor(np.asarray(x, np.int32))

    out = torch.full(case.q.shape, float("nan"), dtype=dtype)  # poisoned
    tiling = Tiling.resolve(case.q.shape[0], case.block_tables.shape[0], cfg.num_q_heads // cfg.num_kv_heads)
    triton_attention.launch_kernel(
        triton_attention.interpreted_kernel(),
        torch.tensor(case.q, dtype=dtype),
        torch.tensor(k_cache, dtype=dtype),
        torch.tensor(v_cache, dtype=dtype),
        ints(case.kv_lens),
        ints(case.block_tables),
        ints(case.query_start_loc),
        ints([case.num_seqs]),
        out,
        sm_scale=case.sm_scale,
        sliding_window=None if cfg.sliding_window is None else ints([cfg.sliding_window]),
        soft_cap=cfg.soft_cap,
        tiling=tiling,
        dtype=cfg.dtype,
    )
    return out.float().numpy().astype(np.float64), case.expected, case.num_real_tokens


def _check(cfg, out, expected, n):
    assert np.isfinite(out[:n]).all(), "a real token's row was not written, or stale cache memory was read"
    np.testing.assert_allclose(out[:n], expected[:n], **tolerance(cfg.dtype))
    assert np.isnan(out[n:]).all(), "a padding token's row was written"


@interpreter
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("config", list(TRITON_CONFIGS))
def test_interpreted_matches_float64_reference(config, batch):
    cfg = TRITON_CONFIGS[config]
    out, expected, n = run_interpreted(
        cfg, BATCHES[batch](cfg.layout.block_size), case_seed("triton", config, batch)
    )
    _check(cfg, out, expected, n)


@interpreter
def test_padding_does_not_affect_real_tokens():
    cfg = CONFIGS["gqa2"]
    seqs = BATCHES["mixed"](cfg.layout.block_size)
    out_a, expected, n = run_interpreted(cfg, seqs, 99, padding_seed=0)
    out_b, _, _ = run_interpreted(cfg, seqs, 99, padding_seed=1)
    np.testing.assert_array_equal(out_a[:n], out_b[:n])
    _check(cfg, out_a, expected, n)


@interpreter
def test_only_padding_writes_nothing():
    out, _, n = run_interpreted(CONFIGS["gqa2"], [], 5)
    assert n == 0 and np.isnan(out).all()


@interpreter
@pytest.mark.parametrize("batch", ["decode", "mixed"])
def test_nan_in_stale_slots_is_not_read(batch):
    cfg = CONFIGS["gqa8_window"]
    out, expected, n = run_interpreted(
        cfg, BATCHES[batch](cfg.layout.block_size), case_seed("triton", "stale", batch), poison_tails=True
    )
    _check(cfg, out, expected, n)


def test_compiles_to_sm90_cubin():
    """The compiled (not interpreted) kernel goes through Triton's whole pipeline to an sm_90 cubin."""
    from test_pallas_attention import compile_in_subprocess

    out = compile_in_subprocess("triton")
    assert out.count("ok   triton sm_90") == 2, out


@requires_gpu
@pytest.mark.parametrize("config", ["gqa2", "gqa8_window", "gqa2_window_cap", "bfloat16", "gqa3"])
def test_jax_triton_launch_matches_float64_reference(config):
    cfg = TRITON_CONFIGS[config]
    op = _JAX_TRITON_OP
    for batch in ("decode", "mixed"):
        out, expected, _, _, info = run_case(
            cfg, BATCHES[batch](cfg.layout.block_size), case_seed("jax-triton", config, batch), attention=op
        )
        n = info["num_real_tokens"]
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out[:n], expected[:n], **tolerance(cfg.dtype))
        np.testing.assert_array_equal(out[n:], 0.0)


_JAX_TRITON_OP = partial(triton_attention.ragged_paged_attention)  # one object: one jitted step per shape
