"""The CPU attention op (kernels/cpu_ops.py, a C++ XLA FFI handler): the reference backend's
decode, few and short paths on a bfloat16 cache stored as words call it on CPU. Each shape it has a
compiled-in form for (head_dim 64 and 128 by groups 1-8) and the generic loop, against the float64
oracle; it is in the compiled step; turned off or unbuildable, the jnp paths serve the same numbers."""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.attention_cases import BATCHES, AttnConfig, Layout, case_seed, run_case, tolerance
from xlaserve.kernels import cpu_ops
from xlaserve.kernels.dtype_ops import as_words
from xlaserve.kernels.reference import ragged_paged_attention

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu" or not cpu_ops.available(), reason="a CPU with a C++ compiler"
)

_SMALL = Layout(num_tokens=128, num_padded_seqs=8, max_blocks_per_seq=16, num_blocks=96)


def _config(q_heads, kv_heads, head_dim, dtype="bfloat16", **kw) -> AttnConfig:
    layout = dataclasses.replace(_SMALL, head_dim=head_dim, **kw.pop("layout", {}))
    return AttnConfig(q_heads, kv_heads, dtype=dtype, layout=layout, **kw)


CPU_CONFIGS = {
    # SmolLM2's heads (9 query, 3 KV, head_dim 64): the form the engine's decode step runs.
    "smollm2": _config(9, 3, 64),
    "d128_gqa4_cap": _config(8, 2, 128, soft_cap=2.0),
    "d64_mha_window": _config(2, 2, 64, sliding_window=21),
    "d64_gqa4_window_sinks": _config(8, 2, 64, sliding_window=21, sinks=True),  # gpt-oss's layers
    # No compiled-in form (head_dim 16, group 5): the generic loop, one task per (query, KV head).
    "generic_gqa5": _config(10, 2, 16, sliding_window=9),
    "generic_gqa5_sinks": _config(10, 2, 16, sinks=True),
    # A block size that divides neither the contexts nor 16.
    "block5": _config(6, 2, 64, layout={"block_size": 5, "max_blocks_per_seq": 41, "num_blocks": 160}),
    # A float32 cache (the float32 engines: Hugging Face parity), compiled-in and generic forms.
    "float32_smollm2": _config(9, 3, 64, dtype="float32"),
    "float32_generic_window_sinks": _config(10, 2, 16, dtype="float32", sliding_window=9, sinks=True),
}


def _on_words(q, k_cache, v_cache, *args, **kwargs):
    """The reference backend's layout: a bfloat16 cache held as its uint16 words (float32 as it is)."""
    if k_cache.dtype == jnp.bfloat16:
        k_cache, v_cache = as_words(k_cache), as_words(v_cache)
    return ragged_paged_attention(q, k_cache, v_cache, *args, **kwargs)


_ATTENTION = partial(_on_words, few_queries=8)


@pytest.mark.parametrize("batch", ["decode", "mixed", "verify"])
@pytest.mark.parametrize("config", list(CPU_CONFIGS))
def test_cpu_op_matches_float64(config, batch):
    cfg = CPU_CONFIGS[config]
    seqs = [(min(ctx, 150), num) for ctx, num in BATCHES[batch](cfg.layout.block_size)]
    n = sum(num for _, num in seqs)
    for poison_tails in (False, True):  # NaN in the unused slots of the last pages must not leak
        out, expected, *_ = run_case(
            cfg, seqs, case_seed(config, batch), attention=_ATTENTION, poison_tails=poison_tails
        )
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out[:n], expected[:n], **tolerance(cfg.dtype))
        np.testing.assert_array_equal(out[n:], 0.0)


def _compiled(attention, cfg):
    lay = cfg.layout
    args = (
        jnp.zeros((8, cfg.num_q_heads, lay.head_dim), jnp.bfloat16),
        jnp.zeros((lay.num_blocks, lay.block_size, cfg.num_kv_heads, lay.head_dim), jnp.uint16),
        jnp.zeros((lay.num_blocks, lay.block_size, cfg.num_kv_heads, lay.head_dim), jnp.uint16),
        jnp.ones(8, jnp.int32),
        jnp.zeros((8, lay.max_blocks_per_seq), jnp.int32),
        jnp.arange(9, dtype=jnp.int32),
        jnp.int32(8),
    )
    return jax.jit(partial(attention, sm_scale=0.125)).lower(*args).compile().as_text()


def _targets(hlo: str) -> set[str]:
    return set(re.findall(r'custom_call_target="(xlaserve_[a-z0-9_]+)"', hlo))


def test_words_and_float32_caches_call_their_op_and_others_do_not():
    cfg = CPU_CONFIGS["smollm2"]
    assert _targets(_compiled(ragged_paged_attention, cfg)) == {cpu_ops.TARGET}
    lay = cfg.layout

    def hlo(q_dtype, cache_dtype):
        cache = jnp.zeros((lay.num_blocks, lay.block_size, cfg.num_kv_heads, lay.head_dim), cache_dtype)
        return jax.jit(partial(ragged_paged_attention, sm_scale=0.125)).lower(
            jnp.zeros((8, cfg.num_q_heads, lay.head_dim), q_dtype), cache, cache, jnp.ones(8, jnp.int32),
            jnp.zeros((8, lay.max_blocks_per_seq), jnp.int32), jnp.arange(9, dtype=jnp.int32), jnp.int32(8),
        ).compile().as_text()  # fmt: skip

    # A float32 cache (the float32 engines, HF parity) calls the op's float32 handler; a float16
    # cache (uint16 words of float16) keeps the jnp paths.
    assert _targets(hlo(jnp.float32, jnp.float32)) == {cpu_ops.F32_TARGET}
    assert _targets(hlo(jnp.float16, jnp.uint16)) == set()


def test_turned_off_the_jnp_paths_give_the_same_numbers(monkeypatch):
    cfg = CPU_CONFIGS["smollm2"]
    seqs = BATCHES["mixed"](cfg.layout.block_size)
    on, expected, *_ = run_case(cfg, seqs, 3, attention=partial(_on_words, few_queries=8))
    monkeypatch.setenv(cpu_ops.DISABLE_ENV, "0")
    assert cpu_ops.TARGET not in _compiled(ragged_paged_attention, cfg)
    off, *_ = run_case(cfg, seqs, 3, attention=partial(_on_words, few_queries=7))  # a new trace
    n = sum(num for _, num in seqs)
    for out in (on, off):
        np.testing.assert_allclose(out[:n], expected[:n], **tolerance(cfg.dtype))
    # The op keeps q and the probabilities in float32 where the jnp path rounds them to bfloat16.
    assert np.abs(on[:n] - expected[:n]).mean() < np.abs(off[:n] - expected[:n]).mean()


def test_inactive_rows_with_garbage_tables_read_nothing():
    """Padding rows' tables hold whatever the host left there (here: page ids far outside the cache);
    the op reads no page of an inactive row, and an active row never outside the cache."""
    d, heads, group, num_blocks, bs = 64, 3, 3, 8, 16
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(3, heads, group, d)), jnp.float32)
    cache = as_words(jnp.asarray(rng.normal(size=(num_blocks, bs, heads, d)), jnp.bfloat16))
    tables = jnp.asarray([[0, 1, 2, 3], [10**6, -5, 10**9, 7], [4, 10**6, 5, 6]], jnp.int32)
    position = jnp.asarray([40, 63, 40], jnp.int32)
    active = jnp.asarray([True, False, True])
    out = np.asarray(jax.jit(cpu_ops.paged_attention)(q, cache, cache, tables, position, active))
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[1], 0.0)
    # Row 2's second page is outside the cache: its 16 keys are skipped, the rest attended.
    keys = np.asarray(jax.lax.bitcast_convert_type(cache, jnp.bfloat16), np.float64)
    visible = {0: np.concatenate([keys[0], keys[1], keys[2][:9]]), 2: np.concatenate([keys[4], keys[5][:9]])}
    for row, k in visible.items():
        s = np.einsum("hgd,thd->hgt", np.asarray(q[row], np.float64), k)
        p = np.exp(s - s.max(-1, keepdims=True))
        want = np.einsum("hgt,thd->hgd", p / p.sum(-1, keepdims=True), k)
        np.testing.assert_allclose(out[row], want, rtol=1e-4, atol=1e-4)


def test_built_once_per_source_and_a_failed_build_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("XLASERVE_CACHE_ROOT", str(tmp_path))
    compiler = cpu_ops.shutil.which("g++")
    libraries = {
        target: cpu_ops._build(compiler, target) for target in (cpu_ops.TARGET, cpu_ops.QUANTIZED_TARGET)
    }
    built = {}
    for library in libraries.values():
        assert library.is_file() and library.is_relative_to(tmp_path)
        built[library] = library.stat().st_mtime_ns
    assert all(cpu_ops._build(compiler, target) == library for target, library in libraries.items())  # reused
    assert all(library.stat().st_mtime_ns == t for library, t in built.items())
    assert not list(tmp_path.rglob("*.tmp"))  # the temporary files were renamed into place

    # A compiler that fails: no library, a warning naming why, the jnp paths serve.
    monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.setenv("XLASERVE_CACHE_ROOT", str(tmp_path / "other"))
    monkeypatch.setattr(cpu_ops, "_register_once", cpu_ops._register_once.__wrapped__)
    with caplog.at_level(logging.WARNING, logger=cpu_ops.__name__):
        assert not cpu_ops.available() and not cpu_ops.available(cpu_ops.QUANTIZED_TARGET)
    assert "did not build" in caplog.text
    assert not list((tmp_path / "other").rglob("*.so"))
    assert cpu_ops.TARGET not in _compiled(ragged_paged_attention, CPU_CONFIGS["smollm2"])


def test_each_op_builds_on_its_own_thread_at_once(monkeypatch):
    # A cold start builds the ops the engine will call while its weights load: each on its own thread,
    # so a slow build (the attention op's) never holds up another (the dot the weights are packed for).
    targets = (cpu_ops.TARGET, cpu_ops.BF16_MATMUL_TARGET)
    started = {target: threading.Event() for target in targets}
    overlapped, done = {}, threading.Semaphore(0)

    def build(compiler, target):
        started[target].set()
        (other,) = set(targets) - {target}
        overlapped[target] = started[other].wait(timeout=20)  # the other's build under way meanwhile
        done.release()
        raise OSError("not built in this test")

    monkeypatch.setattr(cpu_ops, "_build", build)
    monkeypatch.setattr(cpu_ops, "_register_once", cpu_ops._register_once.__wrapped__)
    cpu_ops.prepare_in_background(*targets)
    assert all(done.acquire(timeout=60) for _ in targets)
    assert overlapped == dict.fromkeys(targets, True)


# (codes, group size along the inputs, scales' dtype, with zeros): int8 per output channel (one group:
# `--quantization int8`), GGUF's Q8_0 and a K-quant's 16-input groups, 4-bit packed Q4_1 (zeros) and
# Q4_0 (none), float32 scales.
_QUANT_FORMS = {
    "int8_channel": ("int8", None, np.float32, False),
    "q8_0": ("int8", 32, np.float16, False),
    "q6_k_groups": ("int8", 16, np.float32, False),
    "q4_1": ("packed", 32, np.float16, True),
    "q4_0": ("packed", 32, np.float16, False),
    "q4_f32_zeros": ("packed", 16, np.float32, True),
}


def _quantized(form, depth, columns, rng):
    """-> (stored codes, scales, zeros or None, block, packed, the float64 weight they stand for)."""
    kind, group, scale_dtype, with_zero = _QUANT_FORMS[form]
    group = group or depth
    if kind == "int8":
        codes = rng.integers(-127, 128, (depth, columns)).astype(np.int8)
        stored = codes
    else:
        codes = rng.integers(0, 16, (depth, columns)).astype(np.uint8)
        stored = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)
    scale = (rng.random((depth // group, columns)) * 0.02 + 1e-3).astype(scale_dtype)
    zero = (rng.standard_normal((depth // group, columns)) * 0.05).astype(scale_dtype) if with_zero else None
    weight = codes.astype(np.float64) * np.repeat(scale.astype(np.float64), group, axis=0)
    if zero is not None:
        weight += np.repeat(zero.astype(np.float64), group, axis=0)
    block = None if _QUANT_FORMS[form][1] is None else (group, 1)
    return stored, scale, zero, block, kind == "packed", weight


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("form", list(_QUANT_FORMS))
def test_quantized_matmul_matches_float64(form, rows):
    from xlaserve.kernels.dtype_ops import matmul

    rng = np.random.default_rng(case_seed(form, str(rows)))
    # 1,040 columns: two whole 512-column tasks and a 16-column remainder.
    codes, scale, zero, block, packed, weight = _quantized(form, 96, 1040, rng)
    x = jnp.asarray(rng.standard_normal((rows, 96)), jnp.bfloat16)
    args = (x, jnp.asarray(codes), jnp.asarray(scale), None if zero is None else jnp.asarray(zero))
    # One compile: the executable whose text is read is the one that runs.
    step = jax.jit(lambda x, w, s, z: matmul(x, w, jnp.float32, s, z, block, packed)).lower(*args).compile()
    assert cpu_ops.QUANTIZED_TARGET in step.as_text()
    want = np.asarray(x, np.float64) @ weight
    np.testing.assert_allclose(
        np.asarray(step(*args), np.float64), want, rtol=1e-5, atol=1e-5 * np.abs(want).max()
    )


def test_quantized_matmul_serves_few_rows_only():
    """Measured crossovers: XLA's dot wins from 4 rows of an int8 weight; 4-bit codes stay to 8."""
    from xlaserve.kernels.dtype_ops import matmul

    rng = np.random.default_rng(0)
    for form, rows, served in (("q8_0", 2, True), ("q8_0", 4, False), ("q4_1", 8, True), ("q4_1", 9, False)):
        codes, scale, zero, block, packed, weight = _quantized(form, 64, 64, rng)
        x = jnp.asarray(rng.standard_normal((rows, 64)), jnp.bfloat16)
        args = (x, jnp.asarray(codes), jnp.asarray(scale), None if zero is None else jnp.asarray(zero))
        step = (
            jax.jit(
                lambda x, w, s, z, block=block, packed=packed: matmul(x, w, jnp.float32, s, z, block, packed)
            )
            .lower(*args)
            .compile()
        )
        assert (cpu_ops.QUANTIZED_TARGET in step.as_text()) == served, (form, rows)
        want = np.asarray(x, np.float64) @ weight
        np.testing.assert_allclose(
            np.asarray(step(*args), np.float64), want, rtol=2e-2, atol=2e-2 * np.abs(want).max()
        )


def test_a_serialized_program_names_the_ops_it_calls():
    """The program store registers these before it loads a stored executable (worker/program_store.py)."""
    from jax.experimental import serialize_executable

    q = jnp.zeros((2, 1, 1, 16), jnp.float32)
    cache = jnp.zeros((4, 4, 1, 16), jnp.uint16)
    args = (q, cache, cache, jnp.zeros((2, 2), jnp.int32), jnp.zeros(2, jnp.int32), jnp.ones(2, bool))
    compiled = jax.jit(cpu_ops.paged_attention).lower(*args).compile()
    blob, _, _ = serialize_executable.serialize(compiled)
    assert cpu_ops.targets_called_by(blob) == [cpu_ops.TARGET]
    plain, _, _ = serialize_executable.serialize(jax.jit(lambda x: x * 2).lower(q).compile())
    assert cpu_ops.targets_called_by(plain) == []
