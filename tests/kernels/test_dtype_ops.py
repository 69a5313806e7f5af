"""16-bit float data movement kept native on CPU (kernels/dtype_ops.py): a KV cache stored as
uint16 words gives bit-identical attention, and the compiled op never converts the whole cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.kernels import reference
from xlaserve.kernels.dtype_ops import as_words, from_words, matmul, scan, stack_entry

NUM_BLOCKS, BLOCK, KV_HEADS, HEADS, DIM = 64, 4, 2, 4, 16
ON_CPU = pytest.mark.skipif(jax.default_backend() != "cpu", reason="forms chosen on CPU only")


def step_inputs(rng):
    lens = np.array([9, 17], np.int32)  # two sequences, 3 and 1 new tokens
    new = np.array([3, 1], np.int32)
    qsl = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    tables = np.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], np.int32)
    positions = [(s, p) for s in range(2) for p in range(lens[s] - new[s], lens[s])]
    slots = np.array([tables[s][p // BLOCK] * BLOCK + p % BLOCK for s, p in positions], np.int32)
    t = int(qsl[-1])
    q = jnp.asarray(rng.normal(size=(t, HEADS, DIM)), jnp.bfloat16)
    k = jnp.asarray(rng.normal(size=(t, KV_HEADS, DIM)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(t, KV_HEADS, DIM)), jnp.bfloat16)
    cache = jnp.asarray(rng.normal(size=(NUM_BLOCKS, BLOCK, KV_HEADS, DIM)), jnp.bfloat16)
    return q, k, v, cache, jnp.asarray(lens), jnp.asarray(tables), jnp.asarray(qsl), jnp.asarray(slots)


def attend(q, k, v, k_cache, v_cache, lens, tables, qsl, slots):
    k_cache, v_cache = reference.write_kv(k_cache, v_cache, k, v, slots)
    out = reference.ragged_paged_attention(
        q, k_cache, v_cache, lens, tables, qsl, jnp.int32(2), sm_scale=DIM**-0.5, tokens_per_chunk=8
    )
    return out, k_cache, v_cache


def test_words_cache_is_bit_identical_to_a_bfloat16_cache(monkeypatch):
    # The jnp paths on both (a words cache on CPU otherwise takes the C++ op: test_cpu_ops.py).
    monkeypatch.setenv("XLASERVE_CPU_KERNELS", "0")
    q, k, v, cache, lens, tables, qsl, slots = step_inputs(np.random.default_rng(0))
    want, want_k, _ = jax.jit(attend)(q, k, v, cache, cache * 2, lens, tables, qsl, slots)
    got, got_k, _ = jax.jit(attend)(q, k, v, as_words(cache), as_words(cache * 2), lens, tables, qsl, slots)
    assert got_k.dtype == jnp.uint16 and want.dtype == got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(from_words(got_k, jnp.bfloat16)), np.asarray(want_k))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_compiled_step_never_converts_the_whole_cache_or_weight_stack():
    q, k, v, cache, lens, tables, qsl, slots = step_inputs(np.random.default_rng(1))
    words = as_words(cache)
    stack = jnp.ones((3, DIM * HEADS, DIM * HEADS), jnp.bfloat16)

    def step(q, k, v, k_cache, v_cache, stack):
        out, k_cache, v_cache = attend(q, k, v, k_cache, v_cache, lens, tables, qsl, slots)
        x = out.reshape(out.shape[0], -1)
        x, _ = scan(
            lambda x, w: (jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(x.dtype), None),
            x,
            stack,
        )
        return x, k_cache, v_cache

    hlo = jax.jit(step, donate_argnums=(3, 4)).lower(q, k, v, words, words, stack).compile().as_text()
    for shape in (cache.shape, stack.shape):
        dims = ",".join(map(str, shape))
        assert f"= f32[{dims}]" not in hlo, f"a {shape} array is converted to float32"
    assert f"= u16[{','.join(map(str, cache.shape))}]" in hlo  # the cache stays words end to end


def test_a_stack_entry_is_the_layer_at_its_index_read_without_converting_the_stack():
    """`stack_entry` (a hybrid model's stage reads each stack at its own index, models/hybrid.py): a
    bfloat16 stack, one stored as words (read back as bfloat16) and a float32 one give entry i's bits at
    a traced index inside a loop and at a static one, and the bfloat16 stacks are never converted whole."""
    rng = np.random.default_rng(3)
    bf16 = jnp.asarray(rng.normal(0, 1, (3, 16, 24)), jnp.bfloat16)
    stacks = {
        "bf16": bf16,
        "words": as_words(bf16),
        "f32": jnp.asarray(rng.normal(0, 1, (3, 8)), jnp.float32),
    }

    def read(stacks):  # each entry back as words (a bfloat16 stack of outputs would be converted)
        def body(carry, i):
            entry = stack_entry(stacks, i, words_of=jnp.bfloat16)
            assert entry["bf16"].dtype == entry["words"].dtype == jnp.bfloat16
            return carry, jax.tree.map(as_words, entry)

        _, traced = jax.lax.scan(body, 0, jnp.arange(3, dtype=jnp.int32))
        return traced, stack_entry(stacks, 2, words_of=jnp.bfloat16)

    traced, static = jax.jit(read)(stacks)
    for name, want in (("bf16", bf16), ("words", bf16), ("f32", stacks["f32"])):
        assert static[name].dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(from_words(traced[name], want.dtype)), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(static[name]), np.asarray(want[2]), err_msg=name)

    def layers(x, stacks):  # x through each entry, as a layer loop reads its weights
        def body(x, i):
            w = stack_entry(stacks, i, words_of=jnp.bfloat16)["words"]
            return jnp.matmul(x, w[:, :16], preferred_element_type=jnp.float32).astype(x.dtype), None

        return jax.lax.scan(body, x, jnp.arange(3, dtype=jnp.int32))[0]

    hlo = jax.jit(layers).lower(jnp.ones((4, 16), jnp.bfloat16), stacks).compile().as_text()
    assert "= f32[3,16,24]" not in hlo, "a bfloat16 stack is converted to float32 whole"


def _dot_rows_in(fn, *args) -> set[int]:
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    dots = [line for line in hlo.splitlines() if " dot(" in line]
    assert dots
    return {int(line.split("= f32[")[1].split(",")[0]) for line in dots}


@pytest.fixture
def invariance_of(dtype):
    """Batch invariance on, float32's dots too for a float32 test (`batch_invariant_float32`: not by
    default, kernels/invariant.py `covers_float32`)."""
    from xlaserve.kernels.invariant import batch_invariance

    with batch_invariance(True, float32=dtype == "float32"):
        yield


@ON_CPU
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("num_rows", [1, 2])
def test_few_rows_dot_padded_and_keep_their_bits(num_rows, dtype, invariance_of):
    # XLA CPU's one-row bfloat16 dot (a matrix-vector product) is not native: a batch-1 decode step
    # spent most of its time in the LM head; and a few rows take kernels that round otherwise than the
    # one larger dots share. matmul pads them: outside an engine's trace to MIN_DOT_ROWS, in one
    # (`probing(True)`) to the shape's probed rows, with batch invariance off to two (speed alone). A
    # row has the bits it has inside a 64-row dot (batch invariance), and the values are the dot's.
    # float32's one-row dot is native but rounds otherwise too: padded alike with invariance on (its own
    # probed rows), not at all with it off.
    from xlaserve.kernels import dot_rows, invariant
    from xlaserve.kernels.dtype_ops import MIN_DOT_ROWS

    rng = np.random.default_rng(0)
    many = jnp.asarray(rng.normal(size=(64, 576)), dtype)
    x = many[:num_rows]
    w = jnp.asarray(rng.normal(size=(576, 96)), dtype)

    def plain(x, w):
        return matmul(x, w, jnp.float32)

    assert _dot_rows_in(plain, x, w) == {MIN_DOT_ROWS}
    probed = dot_rows.probe(576, 96, dtype)
    assert _dot_rows_in(dot_rows.traced_probing(True, plain), x, w) == {max(probed, num_rows)}
    off_rows = max(dot_rows.FAST_ROWS, num_rows) if dtype == "bfloat16" else num_rows
    assert _dot_rows_in(invariant.traced_with(False, plain), x, w) == {off_rows}
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    full = np.asarray(matmul(many, w, jnp.float32))[:num_rows]
    for fn in (plain, dot_rows.traced_probing(True, plain)):
        got = np.asarray(jax.jit(fn)(x, w))
        assert got.shape == (num_rows, 96)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(got, full)


@ON_CPU
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("k, n", [(576, 1536), (12, 48)])
def test_probed_rows_keep_every_rows_bits_at_every_count(k, n, dtype, invariance_of):
    # The probe's promise, checked apart from it: under `probing(True)` every count of rows from 1 to
    # 16, by the weight as stored and read transposed (a tied LM head), gives each row the bits it has
    # among 64 rows. A probe that answered too few rows fails here on a CPU whose kernels round
    # otherwise below its threshold (an AMX Xeon: 3 rows for SmolLM2's shapes, up to 11 for 12 x 48).
    # In float32 too (its invariance asked for), whose one-row dot rounds otherwise.
    from xlaserve.kernels import dot_rows

    rng = np.random.default_rng(1)
    many = jnp.asarray(rng.normal(size=(64, k)), dtype)
    w = jnp.asarray(rng.normal(size=(k, n)) / np.sqrt(k), dtype)
    w_t = jnp.asarray(np.asarray(w, np.float32).T, dtype)
    dot = jax.jit(dot_rows.traced_probing(True, lambda x, w: matmul(x, w, jnp.float32)))
    dot_t = jax.jit(dot_rows.traced_probing(True, lambda x, w_t: matmul(x, w_t.T, jnp.float32)))
    # float32: counts about its probed rows, its tile's edge and past it (tiles of 32 rows; YNNPACK's own
    # float32 dot sums K in another order from 33 rows on for K = 576 on an AVX512-BF16 EPYC). A
    # transposed weight only up to the tile: the loop over tiles would read it as a copy (the engine
    # transposes a tied head once).
    counts = range(1, 17) if dtype == "bfloat16" else [1, 2, 3, 5, 8, 16, 31, 32, 33, 40, 48]
    full = np.asarray(dot(many, w))
    many = np.asarray(many)  # sliced on the host: a device array's slice compiles a program per count
    full_t = np.asarray(dot_t(many if dtype == "bfloat16" else many[: dot_rows.TILE_ROWS], w_t))
    for m in counts:
        np.testing.assert_array_equal(np.asarray(dot(many[:m], w)), full[:m], err_msg=f"{m} rows")
        if m <= len(full_t):
            got = np.asarray(dot_t(many[:m], w_t))
            np.testing.assert_array_equal(got, full_t[:m], err_msg=f"{m} rows, w.T")


def test_probed_rows_are_kept_per_machine(tmp_path, monkeypatch):
    # One probe per shape and machine: the answer is read back from the store by a fresh process (here
    # the memo cleared), and a store written for other flags is not this machine's.
    from xlaserve.kernels import dot_rows

    monkeypatch.setenv("XLASERVE_CACHE_ROOT", str(tmp_path))
    monkeypatch.setattr(dot_rows, "_memo", {})
    calls = []
    monkeypatch.setattr(dot_rows, "probe", lambda k, n, dtype: calls.append((k, n, dtype)) or 5)
    with dot_rows.probing(True):
        assert dot_rows.min_rows(40, 24, jnp.bfloat16) == 5
        assert dot_rows.min_rows(40, 24, jnp.bfloat16) == 5
    assert calls == [(40, 24, "bfloat16")]
    monkeypatch.setattr(dot_rows, "_memo", {})
    with dot_rows.probing(True):
        assert dot_rows.min_rows(40, 24, jnp.bfloat16) == 5  # from the store
        assert calls == [(40, 24, "bfloat16")]
        monkeypatch.setattr(dot_rows, "_memo", {})
        monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_other_flag=1")
        assert dot_rows.min_rows(40, 24, jnp.bfloat16) == 5
        assert dot_rows.min_rows(40, 24, jnp.float32) == 5  # each dtype its own answer
    assert len(calls) == 3  # another machine's (flags') answer: probed again; float32's
    assert calls[-1] == (40, 24, "float32")
    assert dot_rows.min_rows(40, 24, jnp.bfloat16) == dot_rows.SAFE_ROWS  # outside an engine's trace
    assert dot_rows.min_rows(40, 24, jnp.float32) == dot_rows.SAFE_ROWS


@ON_CPU
def test_one_row_by_an_int8_weight_is_an_integer_dot_as_exact_as_the_row(monkeypatch):
    # XLA's forms, where the C++ op (kernels/cpu_ops.py: test_cpu_ops.py) is not built.
    monkeypatch.setenv("XLASERVE_CPU_KERNELS", "0")
    # Batch 1 by an int8 weight (--quantization int8): the bfloat16 row is split into two int8 rows
    # (x = s * (hi + lo / 256), s a power of two) and multiplied in int32 (split_int8_matmul). Plain
    # W8A8 (one int8 row: 7 bits) or a lost lo row would miss this bound by ~100x.
    rng = np.random.default_rng(1)
    k, n = 1536, 96
    x64 = rng.normal(size=(1, k)) * np.exp(rng.uniform(-6, 2, size=(1, k)))  # values over ~2**12
    x64[0, :7] = 0.0
    x = jnp.asarray(x64, jnp.bfloat16)
    w = jnp.asarray(rng.integers(-127, 128, size=(k, n)), jnp.int8)
    scale = jnp.asarray(rng.uniform(1e-3, 1e-2, size=(1, n)), jnp.float32)
    # The program whose text is read is the one that runs (eager, every op would compile its own).
    step = jax.jit(lambda x, w, s: matmul(x, w, jnp.float32, scale=s)).lower(x, w, scale).compile()
    hlo = step.as_text()
    dots = [line for line in hlo.splitlines() if " dot(" in line]
    assert dots and all(f"= s32[2,{n}]" in line for line in dots), dots  # int8 x int8 -> int32
    assert f"bf16[{k},{n}]" not in hlo and f"f32[{k},{n}]" not in hlo  # the weight is never converted
    got = np.asarray(step(x, w, scale), np.float64)
    xs = np.asarray(x, np.float64)
    ws = np.asarray(w, np.float64) * np.asarray(scale, np.float64)
    want = xs @ ws
    # Each element is exact or off by <= s / 256, s <= 2 max|x| / 127; float32 adds ~1e-7 relative.
    s_max = 2 * np.abs(xs).max() / 127
    bound = np.abs(ws).sum(axis=0) * s_max / 256 + 1e-6 * (np.abs(xs) @ np.abs(ws))
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)
    # Elements at >= s / 2 are represented exactly: then only float32 rounding remains.
    big = jnp.asarray(np.sign(x64) * rng.uniform(0.5, 1.0, size=(1, k)) * 100, jnp.bfloat16)
    got = np.asarray(step(big, w, scale), np.float64)
    np.testing.assert_allclose(got, np.asarray(big, np.float64) @ ws, rtol=1e-6, atol=1e-5)
    zero_row = np.asarray(step(jnp.zeros((1, k), jnp.bfloat16), w, scale))
    assert np.all(zero_row == 0)


@ON_CPU
def test_a_wide_quantized_weight_is_multiplied_a_chunk_of_columns_at_a_time(monkeypatch):
    monkeypatch.setenv("XLASERVE_CPU_KERNELS", "0")  # XLA's forms (see above)
    # XLA CPU does not fuse a quantized weight's convert into the dot: the LM head [576, 49152] was
    # converted to a whole bfloat16 copy each step. Wide weights go through by_column_chunks: no
    # full-size float copy in the program, the values of the dequantized weight's dot.
    from xlaserve.kernels.dtype_ops import COLUMN_CHUNK, dequantize
    from xlaserve.models.quantization import pack_int4

    rng = np.random.default_rng(2)
    k, n = 64, 2 * COLUMN_CHUNK + 100  # two whole chunks and a tail
    x = jnp.asarray(rng.normal(size=(3, k)), jnp.bfloat16)
    xs = np.asarray(x, np.float64)
    w = jnp.asarray(rng.integers(-127, 128, size=(k, n)), jnp.int8)
    scale = jnp.asarray(rng.uniform(1e-3, 1e-2, size=(1, n)), jnp.float32)
    codes = rng.integers(0, 16, size=(k, n)).astype(np.int8)  # GGUF-like 4-bit codes, groups of 32
    g_scale = jnp.asarray(rng.uniform(1e-3, 1e-2, size=(k // 32, n)), jnp.float16)
    g_zero = jnp.asarray(-8 * np.asarray(g_scale, np.float32), jnp.float16)
    packed = jnp.asarray(pack_int4(codes))
    cases = {
        "int8 per channel": ((w, scale, None, None, False), np.asarray(w, np.float64) * np.asarray(scale)),
        "packed 4-bit groups": (
            (packed, g_scale, g_zero, (32, 1), True),
            # the step's dequantization rounds group-scaled weights to x's dtype before the dot
            np.asarray(dequantize(jnp.asarray(codes), g_scale, jnp.bfloat16, g_zero, (32, 1)), np.float64),
        ),
    }
    for name, ((wq, s, z, block, is_packed), dense) in cases.items():

        def f(x, wq, s, z, block=block, is_packed=is_packed):
            return matmul(x, wq, jnp.float32, scale=s, zero=z, block=block, packed=is_packed)

        step = jax.jit(f).lower(x, wq, s, z).compile()  # inspected and run: one compile
        hlo = step.as_text()
        assert f"bf16[{k},{n}]" not in hlo and f"bf16[{k // 2},{n}]" not in hlo, name
        assert "while" in hlo, name  # the loop over chunks
        got = np.asarray(step(x, wq, s, z), np.float64)
        np.testing.assert_allclose(got, xs @ dense, rtol=1e-5, atol=1e-4, err_msg=name)


@ON_CPU
def test_float8_weights_convert_to_bfloat16_exactly_on_cpu():
    # convert_weight turns e4m3 codes into bfloat16 by integer ops on the bits (faster on XLA CPU
    # than its float8 convert): every finite code, subnormals and signed zeros included, must agree.
    from xlaserve.kernels.dtype_ops import convert_weight

    codes = jnp.arange(256, dtype=jnp.uint8)
    w = jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)
    got = np.asarray(jax.jit(lambda w: convert_weight(w, jnp.bfloat16))(w), np.float64)
    want = np.asarray(w.astype(jnp.float32), np.float64)
    finite = ~np.isnan(want)
    assert finite.sum() == 254
    np.testing.assert_array_equal(got[finite], want[finite])
    np.testing.assert_array_equal(np.signbit(got[finite]), np.signbit(want[finite]))
