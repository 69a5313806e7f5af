"""The CPU's batch-invariant bfloat16 dot (kernels/cpu/bf16_matmul.cc, kernels/cpu_dot.py): against the
float64 oracle, each row the same bits at every M and in any companions, packed weights read in place
by the layer scan, and the portable loop (a CPU without AVX512-BF16) held to the same."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.kernels import cpu_ops
from xlaserve.kernels.cpu_dot import PackedWeight, usable
from xlaserve.kernels.dtype_ops import matmul, scan

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu" or not cpu_ops.available(cpu_ops.BF16_MATMUL_TARGET),
    reason="a CPU with a C++ compiler",
)

# SmolLM2's projections, and shapes that pad: an odd K, N not a multiple of the 64-column strips.
SHAPES = [(576, 192), (1536, 576), (33, 100), (7, 5)]
ROWS = [1, 2, 3, 5, 6, 7, 8, 13, 64, 97, 200]  # across the 6-row blocks and the 96-row tasks


def _case(k, n, rows=200, layers=3, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((layers, k, n)) / np.sqrt(k), jnp.bfloat16)
    return x, w


def _oracle(x, w):
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    # float32 sums of K products: a few ulps of the sum of magnitudes
    return x64 @ w64, np.abs(x64) @ np.abs(w64) * 2.0**-20 + 1e-30


@pytest.mark.parametrize("k,n", SHAPES)
def test_matches_float64_and_rows_keep_their_bits_at_every_m(k, n):
    x, w = _case(k, n)
    packed = PackedWeight.pack(w)
    # Other companions: the same rows at another offset.
    starts = [min(7, len(x) - m) for m in ROWS]

    @jax.jit  # one program of many dots (a custom call each): one compile, not one per M
    def dots(x, layer):
        def dot(rows):
            return matmul(rows, packed.at(layer), jnp.float32)

        return dot(x), [(dot(x[:m]), dot(x[s : s + m])) for m, s in zip(ROWS, starts)]

    full, by_m = jax.tree.map(np.asarray, dots(x, 1))
    want, tol = _oracle(x, w[1])
    assert np.all(np.abs(full - want) <= tol)
    for m, start, (head, shifted) in zip(ROWS, starts, by_m):
        assert np.array_equal(head, full[:m]), m
        assert np.array_equal(shifted, full[start : start + m]), m


def test_packing_round_trips_and_updates_repack():
    _, w = _case(33, 100)
    packed = PackedWeight.pack(w)
    assert packed.strips.shape == (3, 2, 17, 64, 2) and packed.shape == (3, 33, 100)
    assert np.array_equal(np.asarray(packed.at(jnp.int32(2)).dense()), np.asarray(w[2]))
    assert packed.at(jnp.int32(2)).shape == (33, 100) and packed.dtype == jnp.bfloat16
    head = PackedWeight.pack(w[0])  # one weight, not a stack
    assert head.shape == (33, 100) and np.array_equal(np.asarray(head.dense()), np.asarray(w[0]))
    # A weight update's path: on the host, the same words and strips.
    words = packed.words(on_host=True)
    assert np.array_equal(words, np.asarray(jax.lax.bitcast_convert_type(w, jnp.uint16)))
    again = PackedWeight.pack(words, packed.strips.sharding)
    assert np.array_equal(np.asarray(again.strips), np.asarray(packed.strips))
    assert np.array_equal(head.words(on_host=True), words[0])


def test_the_scan_hands_each_layer_its_stack_whole():
    x, w = _case(576, 192, rows=4, layers=5)
    packed = PackedWeight.pack(w)
    bias = jnp.arange(5, dtype=jnp.float32)[:, None]  # a scanned leaf beside the packed one

    def body(carry, layer):
        assert layer["kernel"].layer is not None and layer["kernel"].strips.shape[0] == 5  # not sliced
        return carry, matmul(x, layer["kernel"], jnp.float32) + layer["bias"]

    run = jax.jit(lambda p, b: scan(body, 0, {"kernel": p, "bias": b})[1])
    out = np.asarray(run(packed, bias))
    for i in range(5):
        assert np.array_equal(out[i], np.asarray(matmul(x, packed.at(jnp.int32(i)), jnp.float32)) + i)
    stack = "x".join(map(str, packed.strips.shape))  # the stack's type in the program: never sliced
    assert not [
        line for line in run.lower(packed, bias).as_text().splitlines() if "slice" in line and stack in line
    ]
    # Fed to XLA's own dot instead (the matrix itself: MLA's absorbed projection), the same values.
    dense = np.asarray(
        jnp.matmul(x, packed.at(jnp.int32(3)).astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    )
    assert np.allclose(dense, out[3] - 3, rtol=1e-5, atol=1e-5)


def test_portable_loop_is_invariant_and_accurate(monkeypatch):
    # The same source built without AVX512-BF16 (the flag after -march=native wins): the loop a CPU
    # without it runs.
    target = "xlaserve_bf16_matmul_portable_test"
    source, symbol, defines = cpu_ops._OPS[cpu_ops.BF16_MATMUL_TARGET]
    monkeypatch.setitem(cpu_ops._OPS, target, (source, symbol, (*defines, "-mno-avx512bf16")))
    assert cpu_ops.available(target)
    x, w = _case(1536, 576, rows=64, layers=1)
    strips = cpu_ops.pack_for_dot(w)

    @jax.jit
    def dot(x):
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], 576), jnp.float32))
        return call(x, strips, jnp.zeros((1,), jnp.int32))

    full = np.asarray(dot(x))
    want, tol = _oracle(x, w[0])
    assert np.all(np.abs(full - want) <= tol)
    for m in (1, 2, 7, 13):
        assert np.array_equal(np.asarray(dot(x[:m])), full[:m])


def test_packed_only_where_the_op_serves(monkeypatch):
    # One CPU device, bfloat16, the op built; off (`XLASERVE_CPU_KERNELS=0`) the YNNPACK path serves.
    assert usable(jnp.bfloat16, 1)
    assert not usable(jnp.float16, 1) and not usable(jnp.float32, 1) and not usable(jnp.bfloat16, 2)
    monkeypatch.setenv(cpu_ops.DISABLE_ENV, "0")
    assert not usable(jnp.bfloat16, 1)
