"""Paired matmul benchmark of GGUF 4-bit storage (engine/QUANTIZATION.md):

    python -m xlaserve.entrypoints.bench.quant_matmul [--repeats 20]

A scan over 30 layers of [576, 1536] weights (SmolLM2's MLP shape), x of M = 1 and M = 64 rows in
bfloat16, through `kernels/dtype_ops.matmul` as the step calls it, for: bfloat16 weights; 4-bit
codes held one per byte (int8) with float32 group scales and zeros (the path before packing); the
same codes packed two per byte (uint8) with float16 scales and zeros, multiplied as two half-depth
dots (`packed_matmul`, what the step runs); and the packed codes unpacked to [in, out] first. The
variants run interleaved, one call each per repeat, so that other load falls on all alike; medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.kernels.dtype_ops import as_words, matmul, unpack_int4
from xlaserve.kernels.dtype_ops import scan as dtype_scan
from xlaserve.models.quantization import pack_int4

LAYERS, DIN, DOUT, GROUP = 30, 576, 1536, 32


def variants(rng: np.random.Generator) -> dict:
    codes = rng.integers(0, 16, (LAYERS, DIN, DOUT)).astype(np.int8)
    scale = rng.uniform(1e-3, 1e-2, (LAYERS, DIN // GROUP, DOUT)).astype(np.float16)
    zero = (-8 * scale).astype(np.float16)
    dense = jnp.asarray(rng.normal(size=(LAYERS, DIN, DOUT)) * 0.02, jnp.bfloat16)
    block = (GROUP, 1)

    def scan(weights, project):
        # The weights are an argument: closed over, they are constants XLA may fold (a convert of a
        # constant weight costs nothing: that hid the int8 LM head's cost, engine/QUANTIZATION.md).
        def run(x, weights):
            def body(acc, w):
                return acc + project(x, w), None

            init = jnp.zeros((x.shape[0], DOUT), jnp.float32)
            return dtype_scan(body, init, weights, words_of=jnp.bfloat16)[0]

        jitted = jax.jit(run)
        return lambda x: jitted(x, weights)

    def f32_mm(x, w):
        return matmul(x, w[0], jnp.float32, scale=w[1], zero=w[2], block=block)

    def unpacked_mm(x, w):
        return matmul(x, unpack_int4(w[0]), jnp.float32, scale=w[1], zero=w[2], block=block)

    def packed_mm(x, w):
        return matmul(x, w[0], jnp.float32, scale=w[1], zero=w[2], block=block, packed=True)

    int8 = (jnp.asarray(codes), jnp.asarray(scale, jnp.float32), jnp.asarray(zero, jnp.float32))
    packed = (jnp.asarray(pack_int4(codes)), jnp.asarray(scale), jnp.asarray(zero))
    return {
        # stored as words, sliced by the layer scan as the engine does (kernels/dtype_ops.py)
        "bfloat16": (scan(as_words(dense), lambda x, w: matmul(x, w, jnp.float32)), dense),
        "int8 codes": (scan(int8, f32_mm), int8),
        "packed 4-bit": (scan(packed, packed_mm), packed),
        "unpacked first": (scan(packed, unpacked_mm), packed),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    funcs = variants(rng)
    for rows in (1, 64):
        x = jnp.asarray(rng.normal(size=(rows, DIN)), jnp.bfloat16)
        times: dict[str, list[float]] = {name: [] for name in funcs}
        for f, _ in funcs.values():
            f(x).block_until_ready()  # compile
        for _ in range(args.repeats):
            for name, (f, _) in funcs.items():
                t0 = time.perf_counter()
                f(x).block_until_ready()
                times[name].append(time.perf_counter() - t0)
        base = statistics.median(times["bfloat16"])
        for name, (_, weights) in funcs.items():
            median = statistics.median(times[name])
            mib = sum(a.nbytes for a in jax.tree.leaves(weights)) / 2**20
            print(f"M={rows:>2} {name:>14}: {median * 1e3:6.2f} ms ({median / base:.2f}x), {mib:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
