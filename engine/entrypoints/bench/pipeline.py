"""`python -m xlaserve.entrypoints.bench.pipeline`: how much the stages of a pipelined engine overlap
when micro-batches are dispatched back to back (JAX's async dispatch) instead of one at a time.

A micro-batch is one full-bucket forward through every stage (the runner's `_run_forward`: each stage's
program on its own devices, the hidden states `device_put` to the next). With one in flight the host
waits for each; with two, the second is dispatched before the first is waited for, so stage 0 may run
the second while stage 1 runs the first. Reported per micro-batch, paired rounds (both modes in each
round, so the machine's load hits both alike), and how long a dispatch takes to return.

On CPU, run it with fake devices: XLA_FLAGS=--xla_force_host_platform_device_count=2 (they share the
machine's cores, so stages can overlap only as far as one stage leaves cores idle).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax


def _micro_batches(runner, batch, in_flight: int, num: int) -> float:
    """ms per micro-batch over `num` micro-batches, `in_flight` dispatched before each wait."""
    t0 = time.perf_counter()
    for _ in range(num // in_flight):
        jax.block_until_ready([runner._run_forward(batch, {})[0] for _ in range(in_flight)])
    return (time.perf_counter() - t0) / num * 1000


def main(argv: list[str] | None = None) -> int:
    from xlaserve.entrypoints.llm import LLM

    parser = argparse.ArgumentParser(prog="python -m xlaserve.entrypoints.bench.pipeline")
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256, help="the micro-batch's token bucket")
    parser.add_argument("--micro-batches", type=int, default=8, help="per mode and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        pipeline_parallel_size=args.pipeline_parallel_size,
        max_model_len=max(512, args.tokens),
        max_num_batched_tokens=args.tokens,
        max_num_seqs=8,
        kv_cache_memory=2**26,
        enforce_eager=True,  # the one bucket measured compiles on first use
        async_scheduling=False,
    )
    runner = llm.engine_core.runner
    batch = runner._build_batch([], args.tokens)  # a full bucket of padding tokens: the full compute
    jax.block_until_ready(runner._run_forward(batch, {})[0])  # compiles every stage
    dispatch, total = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        hidden = runner._run_forward(batch, {})[0]
        dispatch.append(time.perf_counter() - t0)
        jax.block_until_ready(hidden)
        total.append(time.perf_counter() - t0)
    one, two = [], []
    for _ in range(args.rounds):
        one.append(_micro_batches(runner, batch, 1, args.micro_batches))
        two.append(_micro_batches(runner, batch, 2, args.micro_batches))
    ratios = sorted(a / b for a, b in zip(one, two))
    print(
        f"pipeline_parallel_size={args.pipeline_parallel_size}, {args.tokens} tokens, "
        f"{jax.device_count()} {jax.default_backend()} devices, load {os.getloadavg()[0]:.1f}: "
        f"a micro-batch's dispatch returns after {statistics.median(dispatch) * 1000:.1f} ms of "
        f"{statistics.median(total) * 1000:.1f} ms; per micro-batch, 1 in flight "
        f"{statistics.median(one):.1f} ms, 2 in flight {statistics.median(two):.1f} ms: "
        f"{statistics.median(ratios):.2f}x (rounds {ratios[0]:.2f}-{ratios[-1]:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
