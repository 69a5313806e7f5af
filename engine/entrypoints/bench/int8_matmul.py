"""Paired matmul benchmark of int8 weights (per output channel) on CPU (engine/QUANTIZATION.md):

    python -m xlaserve.entrypoints.bench.int8_matmul [--repeats 15] [--rows 1,2,8,64]

SmolLM2's tied LM head ([576, 49152], alone) and a 30-layer scan of [576, 1536] MLP projections,
x of M rows in bfloat16, the weights passed as arguments (closed over, they would be constants XLA
may fold), for: bfloat16 weights (the engine's path: one row padded to two, the stack sliced as
words); int8 converted to bfloat16 inside the dot (the path before: XLA CPU does not fuse that
convert); the row split into two exact int8 rows and an int8 x int8 -> int32 dot
(`split_int8_matmul`); the head a chunk of columns at a time (`by_column_chunks`); and `matmul`,
which picks among them. Variants interleaved, one call each per repeat; medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.kernels.dtype_ops import as_words, by_column_chunks, matmul, split_int8_matmul
from xlaserve.kernels.dtype_ops import scan as dtype_scan

LAYERS, D, FF, VOCAB = 30, 576, 1536, 49152


def converted(x, w, scale):
    """The path before: int8 -> x's dtype in the dot, the scale on the accumulator (one row padded)."""
    if x.shape[-2] == 1:
        return converted(jnp.concatenate([x, jnp.zeros_like(x)], axis=-2), w, scale)[..., :1, :]
    return jnp.matmul(x, w.astype(x.dtype), preferred_element_type=jnp.float32) * scale[..., 0, :]


def quantized(rng, shape):
    w = rng.normal(size=shape).astype(np.float32) * 0.02
    scale = np.abs(w).max(axis=-2, keepdims=True) / 127
    return jnp.asarray(w, jnp.bfloat16), (jnp.asarray(np.round(w / scale), jnp.int8), jnp.asarray(scale))


def variants(rng) -> dict:
    head_bf16, head_q = quantized(rng, (D, VOCAB))
    mlp_bf16, mlp_q = quantized(rng, (LAYERS, D, FF))

    def layers(project):
        def run(x, weights):
            def body(acc, w):
                return acc + project(x, w), None

            return dtype_scan(body, jnp.zeros((x.shape[0], FF), jnp.float32), weights, words_of=jnp.bfloat16)[
                0
            ]

        return jax.jit(run)

    def f32(fn):
        return lambda x, w: fn(x, *w) if isinstance(w, tuple) else fn(x, w)

    forms = {
        "bfloat16": lambda x, w: matmul(x, w, jnp.float32),
        "int8 converted": converted,
        "int8 split rows": lambda x, w, s: split_int8_matmul(x, w, s[..., 0, :]),
        "int8 matmul": lambda x, w, s: matmul(x, w, jnp.float32, scale=s),
    }
    head = {
        name: (jax.jit(f32(fn)), head_q if name != "bfloat16" else head_bf16) for name, fn in forms.items()
    }
    head["int8 column chunks"] = (
        jax.jit(lambda x, w: by_column_chunks(x, w[0], jnp.float32, w[1], None, None, False)),
        head_q,
    )
    mlp = {
        name: (layers(f32(fn)), mlp_q if name != "bfloat16" else as_words(mlp_bf16))
        for name, fn in forms.items()
    }
    return {f"head [{D}, {VOCAB}]": head, f"{LAYERS} x [{D}, {FF}]": mlp}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rows", default="1,2,8,64")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    for op, all_funcs in variants(rng).items():
        for rows in map(int, args.rows.split(",")):
            x = jnp.asarray(rng.normal(size=(rows, D)), jnp.bfloat16)
            # the one-row forms pad or split themselves; column chunks take >= 2 rows
            funcs = {k: v for k, v in all_funcs.items() if rows > 1 or k != "int8 column chunks"}
            times: dict[str, list[float]] = {name: [] for name in funcs}
            for f, w in funcs.values():
                f(x, w).block_until_ready()  # compile
            for _ in range(args.repeats):
                for name, (f, w) in funcs.items():
                    t0 = time.perf_counter()
                    f(x, w).block_until_ready()
                    times[name].append(time.perf_counter() - t0)
            base = statistics.median(times["bfloat16"])
            cells = [
                f"{n} {statistics.median(t) * 1e3:.2f} ms ({statistics.median(t) / base:.2f}x)"
                for n, t in times.items()
            ]
            print(f"{op} M={rows}: " + "; ".join(cells), flush=True)
    with open("/proc/loadavg") as f:
        print("load average:", " ".join(f.read().split()[:3]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
