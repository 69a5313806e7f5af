"""`python -m xlaserve.entrypoints.bench.attention` (or `xlaserve bench attention`): check each attention
kernel against the reference on this device, time decode and mixed steps, and compare the bandwidth
they reach with the device's copy bandwidth.

It lives with the other benchmarks, above the kernels it measures: kernels/ never imports it.

On a GPU (a few minutes): Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128,
bfloat16, 16-token blocks). The target is decode at batch 64 with 4k-token contexts reading its KV
at >= 70% of the copy bandwidth. A small tiling sweep shows what `block_kv`, `num_warps` and
`num_stages` buy, and the small-batch decode row shows whether a decode-specialized (split-KV)
variant is worth writing: with few sequences, (sequences x KV heads) programs cannot fill the GPU.
Results are appended to kernels/KERNELS.md (`--out`), dated, with the device.

On CPU it runs tiny sizes, Pallas in interpret mode, says so, and writes nothing unless `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import os
import pathlib
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

import xlaserve.kernels
from xlaserve.kernels import reference
from xlaserve.kernels.backend import GPU_PLATFORMS
from xlaserve.kernels.synthetic import StepShape, synthetic_step

DECODE_TARGET = 0.70  # of the copy bandwidth, decode at batch 64 with 4k contexts in bfloat16
LLAMA = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16"}
TINY = {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 32, "dtype": "float32"}

GPU_CASES = {
    "decode b64 ctx4k": StepShape(seqs=((4096, 1),) * 64, **LLAMA),
    "decode b8 ctx4k": StepShape(seqs=((4096, 1),) * 8, **LLAMA),
    "decode b256 ctx1k": StepShape(seqs=((1024, 1),) * 256, **LLAMA),
    # 32 decodes next to two 240-token chunks over cached context: a 512-token step of 64 rows.
    "mixed 512 tokens": StepShape(seqs=((4096, 1),) * 32 + ((2048, 240),) * 2, num_padded_seqs=64, **LLAMA),
    "prefill 2k": StepShape(seqs=((2048, 2048),), **LLAMA),
}
CPU_CASES = {
    "decode b4 ctx256": StepShape(seqs=((256, 1),) * 4, **TINY),
    "mixed 32 tokens": StepShape(seqs=((256, 1),) * 2 + ((96, 30),), num_padded_seqs=4, **TINY),
}
GPU_CHECKS = {
    "mixed bf16 GQA4": StepShape(
        seqs=((300, 1), (77, 77), (500, 40), (1, 1)), num_tokens=128, num_padded_seqs=8, **LLAMA
    ),
    "mixed f32 GQA3 d64": StepShape(
        seqs=((300, 1), (77, 77), (500, 40)),
        num_q_heads=9,
        num_kv_heads=3,
        head_dim=64,
        dtype="float32",
        num_tokens=128,
        num_padded_seqs=8,
    ),
    "decode b64 ctx4k": GPU_CASES["decode b64 ctx4k"],
}
CPU_CHECKS = {"mixed f32": CPU_CASES["mixed 32 tokens"]}
# Multi-head latent attention (kernels/ragged_paged_mla.py): (latent rank, rope dim) and the step.
MLA_GPU_CASES = {  # DeepSeek-V3 at TP 8: 16 heads a device, latents of 512 + 64
    "mla decode b64 ctx4k": (
        512,
        64,
        StepShape(seqs=((4096, 1),) * 64, num_q_heads=16, num_kv_heads=1, head_dim=576, dtype="bfloat16"),
    ),
}
MLA_CPU_CASES = {
    "mla decode b4 ctx256": (
        32,
        16,
        StepShape(seqs=((256, 1),) * 4, num_q_heads=4, num_kv_heads=1, head_dim=48, dtype="float32"),
    ),
}
WINDOW_CAP = {"sliding_window": 200, "soft_cap": 30.0}  # checked on the mixed cases too
TOLERANCE = {"bfloat16": 2e-2, "float32": 1e-4}  # max |kernel - reference| / (1 + |reference|)
SPLIT_SWEEP = [{"num_kv_splits": n} for n in (2, 4, 8, 16)]  # Pallas's split-KV variant, decode cases
SWEEP = [
    {"block_kv": kv, "num_warps": w, "num_stages": st}
    for kv in (32, 64, 128)
    for w in (4, 8)
    for st in (2, 3)
]


@dataclasses.dataclass
class Timing:
    case: str
    kernel: str
    tiling: str
    seconds: float
    kv_bytes: int
    flops: int


def kernel_factories(on_gpu: bool) -> tuple[dict[str, Callable], list[str]]:
    """name -> (tiling kwargs -> attention fn), and a line per kernel that cannot run here."""
    factories, skipped = {"reference": lambda **_: reference.ragged_paged_attention}, []
    from xlaserve.kernels import ragged_paged_attention as pallas

    factories["pallas"] = lambda **t: functools.partial(
        pallas.ragged_paged_attention, interpret=not on_gpu, **t
    )
    if not on_gpu:
        skipped.append("jax-triton: needs a CUDA GPU")
        return factories, skipped
    try:
        import jax_triton  # noqa: F401

        from xlaserve.kernels import triton_attention
    except ImportError as e:
        skipped.append(f"jax-triton: not installed ({e}); pip install 'xlaserve[cuda]'")
    else:
        factories["jax-triton"] = lambda **t: functools.partial(triton_attention.ragged_paged_attention, **t)
    return factories, skipped


def time_call(fn: Callable, args: tuple, min_seconds: float, min_iters: int) -> float:
    """Seconds per call, after one untimed call (compile, warm caches)."""
    jax.block_until_ready(fn(*args))
    iters, start = 0, time.perf_counter()
    while True:
        out = fn(*args)
        iters += 1
        if iters >= min_iters and time.perf_counter() - start >= min_seconds:
            break
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters


def copy_bandwidth(num_bytes: int, min_seconds: float) -> tuple[float, str]:
    """Bytes per second moved by a device-to-device copy (read + write) of a `num_bytes` buffer."""
    x = jnp.ones((num_bytes // 2,), jnp.bfloat16)
    results = {}
    for name, fn in (("jnp.copy", jax.jit(jnp.copy)), ("x + 1", jax.jit(lambda a: a + 1))):
        seconds = time_call(fn, (x,), min_seconds, 5)
        results[name] = 2 * x.nbytes / seconds
    # A copy XLA elided would show an impossible rate: then the elementwise kernel stands in.
    name = "jnp.copy" if results["jnp.copy"] < 20 * results["x + 1"] else "x + 1"
    return results[
        name
    ], f"{name}, {num_bytes / 2**30:.2g} GiB buffer (x + 1: {results['x + 1'] / 1e9:.0f} GB/s)"


def max_rel_error(got: jax.Array, want: jax.Array) -> float:
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return float(jnp.max(jnp.abs(got - want) / (1.0 + jnp.abs(want))))


def run(args) -> str:
    device = jax.devices()[0]
    on_gpu = device.platform in GPU_PLATFORMS
    lines = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    today = datetime.date.today().isoformat()
    say(f"### {today} · {device.device_kind} ({device.platform}) · jax {jax.__version__}")
    say()
    if not on_gpu:
        say("On CPU: tiny sizes, Pallas in interpret mode. These numbers say nothing about GPU speed.")
        say()
    factories, skipped = kernel_factories(on_gpu)
    if args.kernels:
        factories = {k: v for k, v in factories.items() if k in args.kernels.split(",") or k == "reference"}
    for line in skipped:
        say(f"- skipped {line}")
    min_seconds = 0.2 if on_gpu else 0.0
    min_iters = 10 if on_gpu else 2

    bandwidth, how = copy_bandwidth(2**30 if on_gpu else 2**24, min_seconds)
    say(f"- copy bandwidth: {bandwidth / 1e9:.0f} GB/s ({how})")
    say()

    say("| check | kernel | max rel. error | ok |")
    say("|---|---|---|---|")
    failed = set()
    for name, shape in (GPU_CHECKS if on_gpu else CPU_CHECKS).items():
        data = synthetic_step(shape, seed=1)
        for extra in ({}, WINDOW_CAP) if "mixed" in name else ({},):
            kw = dict(sm_scale=shape.head_dim**-0.5, **extra)
            want = jax.jit(functools.partial(reference.ragged_paged_attention, **kw))(*data)
            for kernel, make in factories.items():
                if kernel == "reference":
                    continue
                label = name + (" + window + cap" if extra else "")
                try:
                    error = max_rel_error(jax.jit(functools.partial(make(), **kw))(*data), want)
                except Exception as e:  # noqa: BLE001  (a kernel that fails to compile or run: report, go on)
                    say(f"| {label} | {kernel} | {type(e).__name__}: {str(e)[:200]} | no |")
                    failed.add(kernel)
                    continue
                ok = error <= TOLERANCE[shape.dtype]
                failed |= set() if ok else {kernel}
                say(f"| {label} | {kernel} | {error:.2e} | {'yes' if ok else 'NO'} |")
    say()

    timings: list[Timing] = []
    say("| case | kernel | tiling | time (µs) | KV read (GB/s) | % of copy | TFLOP/s |")
    say("|---|---|---|---|---|---|---|")

    def measure(case: str, shape: StepShape, data, kernel: str, tiling: dict) -> Timing | None:
        fn = jax.jit(functools.partial(factories[kernel](**tiling), sm_scale=shape.head_dim**-0.5))
        label = ", ".join(f"{k}={v}" for k, v in tiling.items()) or "default"
        try:
            seconds = time_call(fn, data, min_seconds, min_iters)
        except Exception as e:  # noqa: BLE001  (report it in the table, time the rest)
            say(f"| {case} | {kernel} | {label} | {type(e).__name__}: {str(e)[:200]} | | | |")
            return None
        t = Timing(case, kernel, label, seconds, shape.kv_bytes_read(), shape.attention_flops())
        say(
            f"| {case} | {kernel} | {label} | {seconds * 1e6:.0f} | {t.kv_bytes / seconds / 1e9:.0f} | "
            f"{100 * t.kv_bytes / seconds / bandwidth:.0f}% | {t.flops / seconds / 1e12:.1f} |"
        )
        timings.append(t)
        return t

    cases = GPU_CASES if on_gpu else CPU_CASES
    for case, shape in cases.items():
        data = synthetic_step(shape, seed=2)
        for kernel in factories:
            if kernel not in failed:
                measure(case, shape, data, kernel, {})
    if on_gpu and not args.quick:
        for case in ("decode b64 ctx4k", "mixed 512 tokens"):
            shape = cases[case]
            data = synthetic_step(shape, seed=2)
            for kernel in factories:
                if kernel != "reference" and kernel not in failed:
                    for tiling in (
                        SWEEP if case.startswith("decode") else [{"block_q": q} for q in (4, 8, 32)]
                    ):
                        measure(case, shape, data, kernel, tiling)
        if "pallas" in factories and "pallas" not in failed:
            for case in ("decode b8 ctx4k", "decode b64 ctx4k"):
                shape = cases[case]
                data = synthetic_step(shape, seed=2)
                for tiling in SPLIT_SWEEP:
                    measure(case, shape, data, "pallas", tiling)
    say()
    mla_section(say, on_gpu, bandwidth, min_seconds, min_iters)
    say()
    say(verdict(timings, bandwidth, on_gpu, failed))
    return "\n".join(lines) + "\n"


def mla_section(say, on_gpu: bool, bandwidth: float, min_seconds: float, min_iters: int) -> None:
    """The Pallas MLA kernel against the MLA reference: error and time; the latent is read once."""
    from xlaserve.kernels.mla import mla_paged_attention
    from xlaserve.kernels.ragged_paged_mla import ragged_paged_mla

    say("| MLA case | kernel | time (µs) | latent read (GB/s) | % of copy | max rel. error |")
    say("|---|---|---|---|---|---|")
    for case, (rank, _, shape) in (MLA_GPU_CASES if on_gpu else MLA_CPU_CASES).items():
        q, cache, _, *rest = synthetic_step(shape, seed=4)
        args = (q[..., :rank], q[..., rank:], cache, *rest)
        scale = shape.head_dim**-0.5
        fns = {
            "reference": jax.jit(functools.partial(mla_paged_attention, sm_scale=scale)),
            "pallas": jax.jit(functools.partial(ragged_paged_mla, sm_scale=scale, interpret=not on_gpu)),
        }
        latent_bytes = sum(ctx for ctx, _ in shape.seqs) * shape.head_dim * jnp.dtype(shape.dtype).itemsize
        want = fns["reference"](*args)
        for name, fn in fns.items():
            try:
                error = max_rel_error(fn(*args), want)
                seconds = time_call(fn, args, min_seconds, min_iters)
            except Exception as e:  # noqa: BLE001  (report it, go on)
                say(f"| {case} | {name} | {type(e).__name__}: {str(e)[:200]} | | | |")
                continue
            rate = latent_bytes / seconds
            say(
                f"| {case} | {name} | {seconds * 1e6:.0f} | {rate / 1e9:.0f} | "
                f"{100 * rate / bandwidth:.0f}% | "
                f"{error:.2e} |"
            )


def verdict(timings: list[Timing], bandwidth: float, on_gpu: bool, failed: set) -> str:
    """The decode target, the fastest kernel (auto's order), and whether small-batch decode lags."""
    out = []
    if failed:
        out.append(f"- FAILED the check against the reference: {', '.join(sorted(failed))} (not timed).")

    def best(case: str, kernel: str | None = None) -> Timing | None:
        rows = [
            t
            for t in timings
            if t.case == case and (kernel is None or t.kernel == kernel) and t.kernel != "reference"
        ]
        return min(rows, key=lambda t: t.seconds, default=None)

    if not on_gpu:
        out.append("- On CPU: no verdict on speed; run this on a GPU.")
        return "\n".join(out)
    b64 = best("decode b64 ctx4k")
    if b64:
        share = b64.kv_bytes / b64.seconds / bandwidth
        met = "met" if share >= DECODE_TARGET else "NOT met"
        out.append(
            f"- Decode target (batch 64, 4k contexts, bf16, >= {DECODE_TARGET:.0%} of copy bandwidth): "
            f"{met}: "
            f"{b64.kernel} ({b64.tiling}) reads KV at {share:.0%}."
        )
        kernels = sorted({t.kernel for t in timings if t.kernel != "reference"})
        order = sorted(
            kernels,
            key=lambda k: sum(
                best(c, k).seconds for c in ("decode b64 ctx4k", "mixed 512 tokens") if best(c, k)
            ),
        )
        out.append(f"- Fastest first (decode b64 + mixed, best tilings): AUTO_GPU_ORDER = {tuple(order)!r}.")
        b8 = best("decode b8 ctx4k", b64.kernel)
        if b8:
            small = b8.kv_bytes / b8.seconds / bandwidth
            lag = "lags: too few programs to fill the GPU" if small < 0.5 * share else "keeps up"
            out.append(
                f"- Decode at batch 8 reads KV at {small:.0%} of copy, best tiling ({b8.kernel}): {lag}."
            )
    for case in ("decode b8 ctx4k", "decode b64 ctx4k"):
        pallas = [t for t in timings if t.case == case and t.kernel == "pallas"]
        unsplit = [t for t in pallas if "num_kv_splits" not in t.tiling]
        split = [t for t in pallas if "num_kv_splits" in t.tiling]
        if unsplit and split:
            a, b = min(unsplit, key=lambda t: t.seconds), min(split, key=lambda t: t.seconds)
            out.append(
                f"- Split-KV on {case}: best {b.tiling} at {b.kv_bytes / b.seconds / bandwidth:.0%} of copy, "
                f"against {a.kv_bytes / a.seconds / bandwidth:.0%} unsplit ({a.tiling}): "
                + (
                    "make it the default for such steps."
                    if b.seconds < 0.9 * a.seconds
                    else "not worth it here."
                )
            )
    return "\n".join(out)


def write_notes(path: str, section: str) -> None:
    """Append `section` under the '## Measurements' heading of `path` (created if missing)."""
    text = pathlib.Path(path).read_text() if os.path.exists(path) else "# Attention kernels\n"
    if "\n## Measurements\n" not in text:
        text = (
            text.rstrip("\n")
            + "\n\n## Measurements\n\n"
            + "Written by `python -m xlaserve.entrypoints.bench.attention`, newest last.\n"
        )
    with open(path, "w") as f:
        f.write(text.rstrip("\n") + "\n\n" + section)


def main(argv: list[str] | None = None, prog: str = "python -m xlaserve.entrypoints.bench.attention") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", help="notes file to append the results to (default on GPU: kernels/KERNELS.md)"
    )
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--quick", action="store_true", help="skip the tiling sweep")
    parser.add_argument(
        "--kernels", help="comma-separated subset of pallas,jax-triton (the reference always runs)"
    )
    args = parser.parse_args(argv)
    section = run(args)
    on_gpu = jax.devices()[0].platform in GPU_PLATFORMS
    # The kernels' notes, beside their sources (installed with them as package data).
    out = args.out or (str(pathlib.Path(xlaserve.kernels.__file__).parent / "KERNELS.md") if on_gpu else None)
    if out and not args.no_write:
        write_notes(out, section)
        print(f"appended to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
