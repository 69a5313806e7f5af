"""The LoRA delta's forms on one decoder layer, interleaved in one process (engine/PERFORMANCE.md):

    python -m xlaserve.entrypoints.bench.lora_forms [--tokens 1,32,64] [--calls 300] [--dtype bfloat16]

One layer's 7 projections (SmolLM2's shapes by default) with `--max-loras` adapter slots of rank
`--rank`, jitted, each form timed by turns so that load from other processes falls on all alike:
the base matmuls alone; the one-hot form the engine runs (models/lora.py), with and without the
`lax.cond` that skips it in a step without adapters; a per-token gather of A[slot] and B[slot];
`jax.lax.ragged_dot` over tokens sorted by slot. Each is run with the tokens spread over the adapters
and with base-model tokens only. Reports microseconds per layer (median) and base / form.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _forms(din: int, dkv: int, dffn: int, num_slots: int, rank: int, dtype):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from xlaserve.models.lora import lora_delta, lora_delta_gathered, lora_delta_ragged

    shapes = {
        "q": (din, din),
        "k": (din, dkv),
        "v": (din, dkv),
        "o": (din, din),
        "gate": (din, dffn),
        "up": (din, dffn),
        "down": (dffn, din),
    }
    rng = np.random.default_rng(0)

    def arr(*shape):
        return jnp.asarray(rng.normal(0, 0.02, shape), dtype)

    w = {k: arr(*s) for k, s in shapes.items()}
    a = {k: arr(s[0], num_slots, rank) for k, s in shapes.items()}  # the engine's [in, S, r]
    b = {k: arr(num_slots, rank, s[1]) for k, s in shapes.items()}
    # The gather and ragged forms need a zero slot for base-model tokens: [S + 1, in, r].
    a_sir = {k: jnp.concatenate([jnp.zeros_like(v[:, :1]), v], 1).transpose(1, 0, 2) for k, v in a.items()}
    b_zero = {k: jnp.concatenate([jnp.zeros_like(v[:1]), v], 0) for k, v in b.items()}

    def inputs(x):  # down_proj's input is the MLP's width
        return {
            k: x if s[0] == din else jnp.tile(x, (1, -(-s[0] // din)))[:, : s[0]] for k, s in shapes.items()
        }

    def mask(slots):
        return jax.nn.one_hot(slots - 1, num_slots, dtype=jnp.float32).repeat(rank, axis=1)

    def base(x, slots):
        return [xs @ w[k] for k, xs in inputs(x).items()]

    def one_hot(x, slots):
        m = mask(slots)
        return [xs @ w[k] + lora_delta(xs, a[k], b[k], m).astype(dtype) for k, xs in inputs(x).items()]

    def one_hot_skip(x, slots):
        m, active = mask(slots), jnp.any(slots > 0)

        def add(y, xs, k):
            return jax.lax.cond(active, lambda: y + lora_delta(xs, a[k], b[k], m).astype(dtype), lambda: y)

        return [add(xs @ w[k], xs, k) for k, xs in inputs(x).items()]

    def gathered(x, slots):
        return [
            xs @ w[k] + lora_delta_gathered(xs, a_sir[k], b_zero[k], slots).astype(dtype)
            for k, xs in inputs(x).items()
        ]

    def ragged(x, slots):
        return [
            xs @ w[k] + lora_delta_ragged(xs, a_sir[k], b_zero[k], slots).astype(dtype)
            for k, xs in inputs(x).items()
        ]

    forms = {"base": base, "one-hot": one_hot, "one-hot + skip": one_hot_skip}
    forms |= {"gathered": gathered, "ragged_dot": ragged}
    return {name: jax.jit(f) for name, f in forms.items()}


def main(argv: list[str] | None = None) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,32,64")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--shape", default="576,192,1536", help="hidden, k/v width, MLP width")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    din, dkv, dffn = (int(v) for v in args.shape.split(","))
    forms = _forms(din, dkv, dffn, args.max_loras, args.rank, jnp.dtype(args.dtype))
    results = []
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        x = jnp.asarray(np.random.default_rng(1).normal(0, 1, (num_tokens, din)), args.dtype)
        spread = jnp.asarray(np.arange(num_tokens) % args.max_loras + 1, jnp.int32)
        for slots_name, slots in (("adapters", spread), ("base only", jnp.zeros(num_tokens, jnp.int32))):
            for f in forms.values():
                jax.block_until_ready(f(x, slots))
            samples = {name: [] for name in forms}
            for _ in range(args.calls):
                for name, f in forms.items():
                    start = time.perf_counter()
                    jax.block_until_ready(f(x, slots))
                    samples[name].append(time.perf_counter() - start)
            us = {name: statistics.median(s) * 1e6 for name, s in samples.items()}
            row = {"tokens": num_tokens, "slots": slots_name, "us": us}
            row["base_over_form"] = {name: us["base"] / t for name, t in us.items()}
            results.append(row)
            print(
                f"{num_tokens:4d} tokens, {slots_name:9s}: "
                + "  ".join(f"{n} {us[n]:.0f} us ({row['base_over_form'][n]:.2f})" for n in forms),
                flush=True,
            )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
