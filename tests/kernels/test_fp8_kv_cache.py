"""`--kv-cache-dtype fp8|fp8_e4m3|fp8_e5m2`: a float8 KV cache with scale 1.0.

The reference stores it as uint8 words (kernels/dtype_ops.py) and the kernels as float8 arrays; on
the same cache every backend gives the reference's output, which is exactly the reference over a
bfloat16 cache holding the same (float8-rounded) values. Writes saturate at the format's largest
value. A byte per value: the same budget holds twice the blocks of a bfloat16 cache.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.config import CacheConfig
from xlaserve.kernels import KVCacheSpec, get_attention_backend, reference
from xlaserve.kernels import ragged_paged_attention as pallas
from xlaserve.kernels.dtype_ops import as_words
from xlaserve.kernels.synthetic import StepShape, synthetic_step
from xlaserve.worker.kv_cache import num_kv_blocks

STEP = StepShape(
    # decode tokens, a fresh prefill, a chunk over cached context, a one-token context; GQA 4; padding
    seqs=((37, 1), (16, 16), (50, 9), (1, 1), (70, 1)),
    num_q_heads=8,
    num_kv_heads=2,
    head_dim=64,
    num_tokens=32,
    num_padded_seqs=6,
)
FP8 = {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}


def fp8_step(name: str, seed: int = 0):
    q, k_cache, v_cache, *rest = synthetic_step(STEP, seed)
    fp8 = FP8[name]
    return q, (k_cache * 4).astype(fp8), (v_cache * 4).astype(fp8), rest  # * 4: past e4m3's subnormals


@functools.cache
def _jitted(attention, **kw):
    return jax.jit(functools.partial(attention, sm_scale=STEP.head_dim**-0.5, **kw))


@pytest.mark.parametrize("name", ["fp8_e4m3", pytest.param("fp8_e5m2", marks=pytest.mark.slow)])
def test_reference_on_words_equals_reference_on_the_same_values_in_bfloat16(name):
    q, k8, v8, rest = fp8_step(name)
    backend = get_attention_backend("reference").with_kv_cache_dtype(name)
    assert backend.cache_dtype(jnp.bfloat16) == jnp.uint8  # stored as words, like a bfloat16 cache
    got = _jitted(backend.attention)(q, as_words(k8), as_words(v8), *rest)
    want = _jitted(reference.ragged_paged_attention)(
        q, k8.astype(jnp.bfloat16), v8.astype(jnp.bfloat16), *rest
    )
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("name", ["fp8_e4m3", pytest.param("fp8_e5m2", marks=pytest.mark.slow)])
def test_pallas_kernel_on_a_float8_cache_matches_the_reference(name):
    q, k8, v8, rest = fp8_step(name, seed=1)
    backend = get_attention_backend("pallas").with_kv_cache_dtype(name)
    assert backend.cache_dtype(jnp.bfloat16) == jnp.dtype(FP8[name])  # the kernels read float8 arrays
    got = np.asarray(_jitted(pallas.ragged_paged_attention, interpret=True)(q, k8, v8, *rest), np.float32)
    words = get_attention_backend("reference").with_kv_cache_dtype(name)
    want = np.asarray(_jitted(words.attention)(q, as_words(k8), as_words(v8), *rest), np.float32)
    num_real = STEP.num_real_tokens
    np.testing.assert_allclose(got[:num_real], want[:num_real], rtol=2e-2, atol=2e-2)
    np.testing.assert_array_equal(got[num_real:], 0.0)


def test_pallas_kernel_on_a_float8_cache_lowers_for_cuda():
    q, k8, v8, rest = fp8_step("fp8_e4m3")
    fn = functools.partial(pallas.ragged_paged_attention, sm_scale=0.125)
    text = jax.jit(fn).trace(q, k8, v8, *rest).lower(lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"stablehlo.custom_call @([\w$.]+)", text) == ["__gpu$xla.gpu.triton"]
    assert "f8E4M3FN" in text  # the cache reaches the kernel as float8, converted inside it


@pytest.mark.parametrize("words", [True, False])
def test_writes_round_to_float8_and_saturate(words):
    backend = get_attention_backend("reference").with_kv_cache_dtype("fp8")
    cache = jnp.zeros((4, 2, 1, 4), jnp.float8_e4m3fn)
    cache = as_words(cache) if words else cache
    new = jnp.asarray([[[1.0, 0.3, -1000.0, 1e9]]], jnp.bfloat16)
    k, _ = backend.write_kv(cache, cache, new, new, jnp.asarray([5], jnp.int32))
    if words:
        k = jax.lax.bitcast_convert_type(k, jnp.float8_e4m3fn)
    row = np.asarray(k[2, 1, 0].astype(jnp.float32))
    np.testing.assert_array_equal(row, [1.0, float(jnp.float8_e4m3fn(0.3)), -448.0, 448.0])


def test_a_float8_cache_holds_twice_the_blocks_of_a_bfloat16_one():
    spec = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64)  # SmolLM2-135M
    cache = CacheConfig(kv_cache_memory=64 * 2**20)
    backend = get_attention_backend("reference")
    bf16 = num_kv_blocks(cache, spec, backend.cache_dtype(jnp.bfloat16))
    fp8 = num_kv_blocks(cache, spec, backend.with_kv_cache_dtype("fp8").cache_dtype(jnp.bfloat16))
    assert fp8 == 2 * bf16


@pytest.mark.skipif(
    jax.default_backend() != "gpu", reason="the jax-triton kernel launches on a CUDA GPU only"
)
def test_jax_triton_kernel_on_a_float8_cache_matches_the_reference():
    q, k8, v8, rest = fp8_step("fp8_e4m3", seed=2)
    backend = get_attention_backend("jax-triton").with_kv_cache_dtype("fp8")
    got = np.asarray(_jitted(backend.attention)(q, k8, v8, *rest), np.float32)
    want = _jitted(reference.ragged_paged_attention)(
        q, k8.astype(jnp.bfloat16), v8.astype(jnp.bfloat16), *rest
    )
    num_real = STEP.num_real_tokens
    np.testing.assert_allclose(got[:num_real], np.asarray(want, np.float32)[:num_real], rtol=2e-2, atol=2e-2)
