"""What is specific to the Pallas ragged paged attention kernel: its tilings, split-KV and traced
windows against the float64 oracle (interpret mode on CPU), the compiled kernel on a GPU, its CUDA
lowering and sm_90 compile, and the engine with `attention_backend="pallas"` against the reference.
The contract it shares with every backend (numerics over the shared configs, padding, stale slots,
errors) is test_attention_contract.py's.

Interpret mode starts every output as NaN (Pallas's "uninitialized" value), so a row no program
writes shows up as NaN, and the wrapper must zero the rows of padding tokens itself.
"""

from __future__ import annotations

import logging
import os
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.attention_cases import (
    BATCHES,
    CONFIGS,
    KERNEL_CONFIGS,
    AttnConfig,
    attend_ahead_case,
    case_seed,
    run_case,
    tolerance,
)
from helpers.cuda_compile_run import compile_in_subprocess
from xlaserve.kernels import (
    ragged_paged_attention as pallas,
)  # the module (the package exports no function of that name)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

INTERPRET = partial(pallas.ragged_paged_attention, interpret=True)


def _check(cfg, out, expected, n):
    assert np.isfinite(out).all(), "NaN: a row no program wrote, or stale cache memory read"
    np.testing.assert_allclose(out[:n], expected[:n], **tolerance(cfg.dtype))
    np.testing.assert_array_equal(out[n:], 0.0)  # padding tokens


requires_gpu = pytest.mark.skipif(
    jax.default_backend() != "gpu", reason="runs the compiled kernel: needs a CUDA GPU"
)
COMPILED = partial(pallas.ragged_paged_attention, interpret=False)


@requires_gpu
@pytest.mark.parametrize("batch", ["decode", "mixed", "one_long_chunk"])
@pytest.mark.parametrize("config", list(KERNEL_CONFIGS))
def test_compiled_on_gpu_matches_float64_reference(config, batch):
    cfg = KERNEL_CONFIGS[config]
    seqs = BATCHES[batch](cfg.layout.block_size)
    out, expected, _, _, info = run_case(
        cfg, seqs, case_seed("pallas-gpu", config, batch), attention=COMPILED
    )
    _check(cfg, out, expected, info["num_real_tokens"])


@requires_gpu
@pytest.mark.parametrize("batch", ["decode", "mixed"])
@pytest.mark.parametrize("config", ["gqa2", "gqa8_window", "bfloat16"])
def test_compiled_split_kv_on_gpu_matches_float64_reference(config, batch):
    cfg = KERNEL_CONFIGS[config]
    seqs = BATCHES[batch](cfg.layout.block_size)
    op = partial(pallas.ragged_paged_attention, interpret=False, block_kv=16, num_kv_splits=4)
    out, expected, _, _, info = run_case(
        cfg, seqs, case_seed("pallas-gpu-split", config, batch), attention=op
    )
    _check(cfg, out, expected, info["num_real_tokens"])


def test_traced_sliding_window():
    """A per-layer window arrives as a traced int32 scalar (Gemma's alternating layers)."""
    cfg = CONFIGS["gqa2_window_cap"]
    seqs = BATCHES["mixed"](cfg.layout.block_size)
    out, expected, _, _, info = run_case(
        cfg, seqs, case_seed("pallas", "traced"), attention=INTERPRET, traced_window=True
    )
    _check(cfg, out, expected, info["num_real_tokens"])


@pytest.mark.parametrize(
    "tiling",
    [{"block_q": 1, "block_kv": 16}, {"block_q": 4, "block_kv": 32}, {"block_q": 64, "block_kv": 128}],
)
def test_tilings_agree(tiling):
    """Query blocks of 1 to 64 tokens (a block spanning many sequences' worth of rows) and context
    tiles of 16 to 128 tokens (more than a whole short context) give the same result."""
    cfg = CONFIGS["gqa8_window"]
    seqs = BATCHES["mixed"](cfg.layout.block_size)
    op = _tiled_op(**tiling)
    out, expected, _, _, info = run_case(cfg, seqs, case_seed("pallas", "tiling", str(tiling)), attention=op)
    _check(cfg, out, expected, info["num_real_tokens"])


@pytest.mark.parametrize("batch", ["decode", "mixed"])
@pytest.mark.parametrize("num_kv_splits", [2, 7])
@pytest.mark.parametrize("config", ["gqa2", "gqa8_window", "gqa2_window_sinks"])
def test_split_kv_matches_float64_reference(config, num_kv_splits, batch):
    """Split-KV: each query block's context tiles shared out over programs, partial softmaxes merged
    by log-sum-exp. 7 splits of a 13-tile context (200 tokens) leave the last split short; a short
    context or a sliding window (gqa8_window: 21 tokens) leaves splits empty. Sinks join at the merge
    (counted once, not once per split)."""
    cfg = CONFIGS[config]
    seqs = BATCHES[batch](cfg.layout.block_size)
    op = _tiled_op(block_kv=16, num_kv_splits=num_kv_splits)
    out, expected, _, _, info = run_case(
        cfg, seqs, case_seed("pallas", "split", config, str(num_kv_splits), batch), attention=op
    )
    _check(cfg, out, expected, info["num_real_tokens"])


_TILED_OPS = {}


def _tiled_op(**tiling):
    key = tuple(sorted(tiling.items()))
    return _TILED_OPS.setdefault(key, partial(pallas.ragged_paged_attention, interpret=True, **tiling))


def _args(cfg: AttnConfig, num_tokens=32, num_seqs=4, dtype=None):
    lay = cfg.layout
    dtype = dtype or cfg.dtype
    sd = jax.ShapeDtypeStruct
    return (
        sd((num_tokens, cfg.num_q_heads, lay.head_dim), dtype),
        sd((lay.num_blocks, lay.block_size, cfg.num_kv_heads, lay.head_dim), dtype),
        sd((lay.num_blocks, lay.block_size, cfg.num_kv_heads, lay.head_dim), dtype),
        sd((num_seqs,), jnp.int32),
        sd((num_seqs, lay.max_blocks_per_seq), jnp.int32),
        sd((num_seqs + 1,), jnp.int32),
        sd((), jnp.int32),
    )


@pytest.mark.parametrize("config", ["gqa3", "gqa8_window", "gqa2_window_cap", "bfloat16", "block5_chunk1"])
def test_lowers_for_cuda(config):
    """The kernel goes through Pallas's Triton lowering (not Mosaic GPU) on this CPU-only machine."""
    cfg = KERNEL_CONFIGS[config]
    fn = partial(
        pallas.ragged_paged_attention, sm_scale=0.1, sliding_window=cfg.sliding_window, soft_cap=cfg.soft_cap
    )
    text = jax.jit(fn).trace(*_args(cfg)).lower(lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"stablehlo.custom_call @([\w$.]+)", text) == ["__gpu$xla.gpu.triton"]


@pytest.mark.parametrize("num_kv_splits", [1, 4])
def test_sinks_lower_for_cuda(num_kv_splits):
    """gpt-oss's sinks: one more (float32) operand of the same single Triton call."""
    cfg = KERNEL_CONFIGS["bfloat16"]
    fn = partial(pallas.ragged_paged_attention, sm_scale=0.1, sliding_window=21, num_kv_splits=num_kv_splits)
    sinks = jax.ShapeDtypeStruct((cfg.num_q_heads,), jnp.float32)
    text = jax.jit(fn).trace(*_args(cfg), sinks=sinks).lower(lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"stablehlo.custom_call @([\w$.]+)", text) == ["__gpu$xla.gpu.triton"]


def test_split_kv_lowers_for_cuda():
    """Split-KV: a 3-D grid and a second (log-sum-exp) output, still one Triton call."""
    cfg = KERNEL_CONFIGS["bfloat16"]
    fn = partial(pallas.ragged_paged_attention, sm_scale=0.1, num_kv_splits=4)
    text = jax.jit(fn).trace(*_args(cfg)).lower(lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"stablehlo.custom_call @([\w$.]+)", text) == ["__gpu$xla.gpu.triton"]


def test_compiles_to_sm90_cubin():
    """Triton's own compiler (the `triton` package, with ptxas) takes the lowered kernel to a cubin."""
    out = compile_in_subprocess("pallas", "decode", "window + cap", "sinks", "image spans")
    # decode, decode with 4 KV splits, window + cap, sinks, Gemma 3's image spans
    assert out.count("ok   pallas sm_90") == 5, out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_kv_splits", [1, 2])
def test_attend_ahead_in_interpret_mode(dtype, num_kv_splits):
    """Gemma 3's image spans (`attend_ahead`) against the float64 oracle the reference is checked
    with (helpers/attention_cases.py), split-KV too; and the call still lowers to one Triton call."""
    operands, kwargs, expected = attend_ahead_case(dtype, words=False)
    fn = partial(pallas.ragged_paged_attention, interpret=True, num_kv_splits=num_kv_splits)
    out = fn(*operands, **kwargs)
    tol = 1e-5 if dtype == "float32" else 3e-2
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=tol, atol=tol)
    lowered = jax.jit(partial(pallas.ragged_paged_attention, num_kv_splits=num_kv_splits, **kwargs))
    text = lowered.trace(*operands).lower(lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"stablehlo.custom_call @([\w$.]+)", text) == ["__gpu$xla.gpu.triton"]


# -- the engine ------------------------------------------------------------------------------------

ENGINE_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
]
# Small and lazily compiled: a 32-token budget chunks the third prompt's prefill next to decodes.
SMALL_ENGINE = {
    "max_model_len": 256,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 32,
    "kv_cache_memory": 16 * 2**20,
    "enforce_eager": True,
    "dtype": "float32",  # also on a GPU, where bfloat16 near-ties could split the two backends
}


@pytest.mark.slow  # two engines, about 35 s on 2 cores
def test_engine_greedy_tokens_match_reference(caplog):
    """SmolLM2 with attention_backend="pallas" (interpret mode) gives the reference backend's greedy
    tokens. Both engines are built here with the same shapes (the shared `llm` has a strict compile
    guard that would count this test's compiles against its next step)."""
    from xlaserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for backend in ("pallas", "reference"):
        with caplog.at_level(logging.INFO):
            engine = LLM(attention_backend=backend, **SMALL_ENGINE)
        assert f"attention backend: {backend}" in caplog.text
        tokens[backend] = [
            list(o.outputs[0].token_ids) for o in engine.generate(ENGINE_PROMPTS, params, use_tqdm=False)
        ]
        del engine
    assert tokens["pallas"] == tokens["reference"]
