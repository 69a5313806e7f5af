"""The contract every paged attention backend keeps, one suite over all of them: the jnp reference,
the Pallas kernel in interpret mode, the Triton kernel under Triton's interpreter (CPU, torch
tensors), and DeepSeek's latent attention (the jnp MLA reference and the Pallas MLA kernel).

On the cases of tests/helpers/attention_cases.py (the engine's layout: shuffled blocks, padding
tokens and sequences, every unreferenced block NaN), each backend matches the float64 oracle, its
real rows do not depend on the padding, a step of padding only reads nothing, NaN in the stale
slots a table reaches is never read, and (if it validates) its errors name the bad argument. A
`Backend` says how to run one on a case: its configs, its padding rows, its error cases. What is
specific to one kernel (tilings, split-KV, CUDA lowering, sm_90 compiles, traced windows, GPU runs)
stays in its own file.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Callable
from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.attention_cases import (
    BATCHES,
    CONFIGS,
    KERNEL_CONFIGS,
    MLA_CONFIGS,
    AttnConfig,
    build_case,
    case_seed,
    reference_op,
    run_case,
    run_mla_case,
    tolerance,
)
from xlaserve.kernels import cpu_ops
from xlaserve.kernels import ragged_paged_attention as pallas
from xlaserve.kernels.attention_args import Tiling
from xlaserve.kernels.mla import mla_paged_attention
from xlaserve.kernels.ragged_paged_mla import ragged_paged_mla
from xlaserve.kernels.reference import ragged_paged_attention

ON_GPU = jax.default_backend() == "gpu"


def _import_triton():
    """-> (torch, triton_attention), or (None, why not). Triton decides once per process, when first
    imported, whether `triton.jit` compiles or interprets, and the interpreted kernel's helpers need
    TRITON_INTERPRET=1: so set it before the import, on CPU. On a GPU Triton compiles, and the
    jax-triton launch tests of test_triton_attention.py check the numerics instead."""
    if ON_GPU:
        return None, "on a GPU Triton compiles; the jax-triton launch tests check numerics"
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        return None, (
            "triton was imported in compile mode before this module could set TRITON_INTERPRET=1; "
            "run this file on its own (python -m pytest tests/kernels/test_attention_contract.py)"
        )
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import torch

        from xlaserve.kernels import triton_attention
    except ImportError as e:
        return None, f"the Triton interpreter needs torch and triton (the test extra): {e}"
    return (torch, triton_attention), None


TRITON, NO_TRITON = _import_triton()


@dataclasses.dataclass(frozen=True)
class Backend:
    """How the suite runs one backend. `run(cfg, seqs, seed, poison_tails=, padding_seed=)` returns
    run_case's (out, expected, k_cache, v_cache, info) as float64; caches None if it writes none."""

    run: Callable
    configs: dict[str, AttnConfig]  # what it supports; its numerics run over all of them
    probe_config: str  # the padding tests'
    stale_configs: tuple[str, ...]
    zeroes_padding_rows: bool = True  # False: a raw launch, which leaves them as they were (NaN)
    alone_tolerance: dict | None = None  # a sequence alone vs. in a batch; None: bit-identical
    bad_arguments: Callable | None = None  # -> (call(**overrides), [(overrides, message)])
    skip: str | None = None


def run_interpreted(cfg: AttnConfig, seqs, seed: int, **case_kw):
    """The Triton kernel under Triton's interpreter, on caches written in numpy. Its output starts
    poisoned (NaN): every real token's row must be written, and padding rows stay NaN."""
    torch, triton_attention = TRITON
    case = build_case(cfg, seqs, seed, **case_kw)
    k_cache, v_cache = case.written_caches()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]

    def ints(x):
        return torch.tensor(np.asarray(x, np.int32))

    out = torch.full(case.q.shape, float("nan"), dtype=dtype)
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
        sinks=None if case.sinks is None else torch.tensor(case.sinks),
        tiling=tiling,
        dtype=cfg.dtype,
    )
    out = out.float().numpy().astype(np.float64)
    return out, case.expected, None, None, {"num_real_tokens": case.num_real_tokens}


def _call_with(op: Callable, good: dict, *, sm_scale: float) -> Callable:
    """call(**overrides): `op` on the good arguments, some replaced (arrays) or added (keywords)."""

    def call(**overrides):
        kw = {**good, **{k: v for k, v in overrides.items() if k in good}}
        static = {k: v for k, v in overrides.items() if k not in good}
        return op(*kw.values(), **{"sm_scale": sm_scale, **static})

    return call


def attention_bad_arguments(op: Callable):
    """The validation of the kernels' wrappers (attention_args.py), on a float32 decode step."""
    case = build_case(CONFIGS["gqa2"], BATCHES["decode"](16), seed=1)
    good = {
        "q": jnp.asarray(case.q, jnp.float32),
        "k_cache": jnp.asarray(np.nan_to_num(case.k_cache), jnp.float32),
        "v_cache": jnp.asarray(np.nan_to_num(case.v_cache), jnp.float32),
        "kv_lens": jnp.asarray(case.kv_lens),
        "block_tables": jnp.asarray(case.block_tables),
        "query_start_loc": jnp.asarray(case.query_start_loc),
        "num_seqs": jnp.int32(case.num_seqs),
    }
    return _call_with(op, good, sm_scale=0.25), [
        ({"q": good["q"][..., :12]}, "head_dim"),
        ({"q": good["q"][:, :3]}, "num_q_heads 3 must be a multiple of num_kv_heads 2"),
        ({"q": good["q"].astype(jnp.bfloat16)}, "dtypes"),
        ({"q": good["q"].astype(jnp.int32)}, "q dtype"),
        ({"v_cache": good["v_cache"][:5]}, "v_cache shape"),
        ({"kv_lens": good["kv_lens"][:3]}, "kv_lens must have shape"),
        ({"query_start_loc": good["query_start_loc"].astype(jnp.float32)}, "query_start_loc must be int32"),
        ({"block_tables": good["block_tables"][0]}, "block_tables must be"),
        ({"num_seqs": jnp.array([3], jnp.int32)}, "num_seqs must have shape ()"),
        ({"sm_scale": 0.0}, "sm_scale"),
        ({"sliding_window": 0}, "sliding_window must be >= 1"),
        ({"soft_cap": -1.0}, "soft_cap"),
        ({"sinks": jnp.zeros(3, jnp.float32)}, "sinks must be None or a float array [num_q_heads=4]"),
        ({"sinks": jnp.zeros(4, jnp.int32)}, "sinks must be None or a float array"),
        ({"block_q": 3}, "block_q must be a power of two"),
        ({"block_kv": 8}, "block_kv must be a power of two >= 16"),
    ]


def mla_bad_arguments(op: Callable, bad: Callable):
    """`bad(good)` -> [(overrides, message)] on a float32 MLA decode step."""
    cfg = MLA_CONFIGS["mla"]
    case = build_case(cfg, BATCHES["decode"](16), seed=1)
    rank = cfg.latent_rank
    good = {
        "q_latent": jnp.asarray(case.q[..., :rank], jnp.float32),
        "q_rope": jnp.asarray(case.q[..., rank:], jnp.float32),
        "latent_cache": jnp.asarray(np.nan_to_num(case.k_cache), jnp.float32),
        "kv_lens": jnp.asarray(case.kv_lens),
        "block_tables": jnp.asarray(case.block_tables),
        "query_start_loc": jnp.asarray(case.query_start_loc),
        "num_seqs": jnp.int32(case.num_seqs),
    }
    return _call_with(op, good, sm_scale=0.1), bad(good)


def _mla_kernel_errors(good):
    return [
        (
            {"q_latent": good["q_latent"][..., :24]},
            "kv_lora_rank must be a power of two >= 16 for the MLA kernel, got 24",
        ),
        (
            {"latent_cache": good["latent_cache"][..., :40]},
            "latent_cache must be [num_blocks, block_size, 1, 48]",
        ),
        ({"block_h": 3}, "block_h must be a power of two"),
        ({"kv_lens": good["kv_lens"].astype(jnp.float32)}, "kv_lens must be int32"),
    ]


def _mla_reference_errors(good):
    return [
        ({"q_rope": good["q_rope"][:, :2]}, "q_rope must be ["),
        (
            {"latent_cache": good["latent_cache"][..., :40]},
            "latent_cache must be [num_blocks, block_size, 1, 48]",
        ),
    ]


@cache
def _mla_reference_op(tokens_per_chunk: int) -> Callable:
    return partial(mla_paged_attention, tokens_per_chunk=tokens_per_chunk)


PALLAS_OP = partial(pallas.ragged_paged_attention, interpret=True)  # one object: one jitted step a shape
MLA_KERNEL_OP = partial(ragged_paged_mla, interpret=True)
ATTENTION_STALE_CONFIGS = ("gqa2", "gqa8_window")


def _reference_jnp(tokens_per_chunk: int) -> Callable:
    """The reference's jnp paths alone: its own object (its own jitted steps), always run, and so
    traced, with the CPU op off."""
    op = _reference_jnp_op(tokens_per_chunk)

    def run(cfg, *args, **kw):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(cpu_ops.DISABLE_ENV, "0")
            return run_case(cfg, *args, attention=op, **kw)

    return run


@cache
def _reference_jnp_op(tokens_per_chunk: int) -> Callable:
    return partial(ragged_paged_attention, tokens_per_chunk=tokens_per_chunk)


BACKENDS = {
    # On CPU the reference calls the C++ op (kernels/cpu_ops.py) for a bfloat16 or float32 cache.
    "reference": Backend(
        run=lambda cfg, *args, **kw: run_case(cfg, *args, attention=reference_op(cfg), **kw),
        configs=CONFIGS,
        probe_config="gqa2",
        stale_configs=ATTENTION_STALE_CONFIGS,
        # Its loop runs to the longest context in the step, so alone it runs fewer (masked) chunks:
        # XLA makes no promise that those leave the sums bit-identical.
        alone_tolerance={"rtol": 1e-6, "atol": 1e-6},
    ),
    # The specification itself, the jnp paths (other platforms, float8 and float16 caches, no compiler).
    "reference-jnp": Backend(
        run=lambda cfg, *args, **kw: _reference_jnp(cfg.tokens_per_chunk)(cfg, *args, **kw),
        configs=CONFIGS,
        probe_config="gqa2",
        stale_configs=ATTENTION_STALE_CONFIGS,
        alone_tolerance={"rtol": 1e-6, "atol": 1e-6},
    ),
    "pallas": Backend(
        run=partial(run_case, attention=PALLAS_OP),
        configs=KERNEL_CONFIGS,
        probe_config="gqa2",
        stale_configs=ATTENTION_STALE_CONFIGS,
        bad_arguments=lambda: attention_bad_arguments(PALLAS_OP),
    ),
    "triton": Backend(
        run=run_interpreted,
        configs=KERNEL_CONFIGS,
        probe_config="gqa2",
        stale_configs=ATTENTION_STALE_CONFIGS,
        zeroes_padding_rows=False,
        # The jax-triton wrapper validates before it traces (and imports jax_triton): this runs on CPU.
        bad_arguments=lambda: attention_bad_arguments(TRITON[1].ragged_paged_attention),
        skip=NO_TRITON,
    ),
    "mla-reference": Backend(
        run=lambda cfg, *args, **kw: run_mla_case(
            cfg, *args, mla=_mla_reference_op(cfg.tokens_per_chunk), **kw
        ),
        configs=MLA_CONFIGS,
        probe_config="mla",
        stale_configs=("mla",),
        alone_tolerance={"rtol": 1e-6, "atol": 1e-6},
        bad_arguments=lambda: mla_bad_arguments(mla_paged_attention, _mla_reference_errors),
    ),
    "mla-pallas": Backend(
        run=partial(run_mla_case, mla=MLA_KERNEL_OP),
        configs=MLA_CONFIGS,
        probe_config="mla",
        stale_configs=("mla",),
        bad_arguments=lambda: mla_bad_arguments(MLA_KERNEL_OP, _mla_kernel_errors),
    ),
}


def _params(*axes: Callable[[Backend], list]) -> list:
    """pytest params (backend, *values) over each backend's declared support; skips carry its reason."""
    params = []
    for name, backend in BACKENDS.items():
        marks = [pytest.mark.skip(reason=backend.skip)] if backend.skip else []
        combos = [()]
        for axis in axes:
            combos = [(*c, v) for c in combos for v in axis(backend)]
        params += [pytest.param(name, *c, marks=marks, id="-".join((name, *c))) for c in combos]
    return params


def check(backend: Backend, cfg: AttnConfig, out, expected, n: int) -> None:
    assert np.isfinite(out[:n]).all(), "a real token's row was not written, or stale cache memory was read"
    np.testing.assert_allclose(out[:n], expected[:n], **tolerance(cfg.dtype))
    check_padding_rows(backend, out[n:])


def check_padding_rows(backend: Backend, rows) -> None:
    if backend.zeroes_padding_rows:
        np.testing.assert_array_equal(rows, 0.0)
    else:
        assert np.isnan(rows).all(), "a padding token's row was written"


@pytest.mark.parametrize(
    ("backend", "config", "batch"), _params(lambda b: list(b.configs), lambda b: list(BATCHES))
)
def test_matches_float64_reference(backend, config, batch):
    chosen, cfg = BACKENDS[backend], BACKENDS[backend].configs[config]
    seqs = BATCHES[batch](cfg.layout.block_size)
    out, expected, k_cache, v_cache, info = chosen.run(cfg, seqs, case_seed(config, batch))
    check(chosen, cfg, out, expected, info["num_real_tokens"])
    if k_cache is None:
        return
    # write_kv (write_latent) put every context token where the block table says, in the cache dtype.
    bs = cfg.layout.block_size
    for blocks, k_ctx, v_ctx in info["contexts"]:
        pos = np.arange(len(k_ctx))
        np.testing.assert_array_equal(k_cache[blocks[pos // bs], pos % bs], k_ctx)
        np.testing.assert_array_equal(v_cache[blocks[pos // bs], pos % bs], v_ctx)


@pytest.mark.parametrize("backend", _params())
def test_padding_does_not_affect_real_tokens(backend):
    """Other padding contents (tokens, and the lengths of padding sequences), and fewer real
    neighbours, leave a sequence's rows identical; padding sequences own no work."""
    chosen = BACKENDS[backend]
    cfg = chosen.configs[chosen.probe_config]
    seqs = BATCHES["mixed"](cfg.layout.block_size)
    n = sum(num for _, num in seqs)
    out_a, expected, *_ = chosen.run(cfg, seqs, 1234, padding_seed=0)
    out_b, *_ = chosen.run(cfg, seqs, 1234, padding_seed=1)
    np.testing.assert_array_equal(out_a, out_b)  # NaN (unwritten) rows compare equal
    check(chosen, cfg, out_a, expected, n)

    # The first sequence alone (the rest is padding): its rows as in the batch, the rest padding.
    first_new = seqs[0][1]
    alone, *_ = chosen.run(cfg, seqs[:1], 1234, padding_seed=2)
    if chosen.alone_tolerance is None:
        np.testing.assert_array_equal(alone[:first_new], out_a[:first_new])
    else:
        np.testing.assert_allclose(alone[:first_new], out_a[:first_new], **chosen.alone_tolerance)
    check_padding_rows(chosen, alone[first_new:])


@pytest.mark.parametrize("backend", _params())
def test_only_padding(backend):
    """A step with no real sequence (a warm-up batch) reads no context and writes only padding rows."""
    chosen = BACKENDS[backend]
    out, _, _, _, info = chosen.run(chosen.configs[chosen.probe_config], [], 7)
    assert info["num_real_tokens"] == 0
    check_padding_rows(chosen, out)


@pytest.mark.parametrize(
    ("backend", "config", "batch"), _params(lambda b: list(b.stale_configs), lambda b: ["decode", "mixed"])
)
def test_nan_in_stale_slots_is_not_read(backend, config, batch):
    """Slots a sequence's table reaches but its context does not (the tail of its last block, the
    null block of padded table entries) hold whatever an earlier request left there, possibly
    inf/NaN from an overflow. Masked scores must not let them into the result: 0 * NaN is NaN, so
    values past the context must be dropped, not just weighted by zero (vLLM zeroes them)."""
    chosen, cfg = BACKENDS[backend], BACKENDS[backend].configs[config]
    seqs = BATCHES[batch](cfg.layout.block_size)
    out, expected, _, _, info = chosen.run(cfg, seqs, case_seed("stale", config, batch), poison_tails=True)
    check(chosen, cfg, out, expected, info["num_real_tokens"])


@pytest.mark.parametrize("backend", [p for p in _params() if BACKENDS[p.values[0]].bad_arguments is not None])
def test_errors_name_the_bad_argument(backend):
    call, bad = BACKENDS[backend].bad_arguments()
    for overrides, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            call(**overrides)
