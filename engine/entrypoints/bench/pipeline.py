"""`python -m xlaserve.entrypoints.bench.pipeline`: how much the stages of a pipelined engine overlap
when micro-batches are dispatched back to back (JAX's async dispatch) instead of one at a time.

A micro-batch is one full-bucket forward through every stage (the runner's `_run_forward`: each stage's
program on its own devices, the hidden states `device_put` to the next). With one in flight the host
waits for each; with two, the second is dispatched before the first is waited for, so stage 0 may run
the second while stage 1 runs the first. Reported per micro-batch, paired rounds (both modes in each
round, so the machine's load hits both alike), and how long a dispatch takes to return.

Then the engine itself (`--requests` > 0): the same greedy requests generated with up to
pipeline_parallel_size steps (micro-batches of different requests) in flight, as the engine core runs
by default on accelerators (on a CPU it keeps one: the stages share its cores), and with one
(`EngineCore.set_num_micro_batches(1)`): output tokens per second, time per step, the most steps in
flight, and whether both modes gave the same tokens. Paired rounds as above.

On CPU, run it with fake devices: XLA_FLAGS=--xla_force_host_platform_device_count=2 (they share the
machine's cores, so stages can overlap only as far as one stage leaves cores idle).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import numpy as np


def _micro_batches(runner, batch, in_flight: int, num: int) -> float:
    """ms per micro-batch over `num` micro-batches, `in_flight` dispatched before each wait."""
    t0 = time.perf_counter()
    for _ in range(num // in_flight):
        jax.block_until_ready([runner._run_forward(batch, {})[0] for _ in range(in_flight)])
    return (time.perf_counter() - t0) / num * 1000


def _generate(llm, prompts: list, params, num_micro_batches: int) -> tuple[float, float, list]:
    """(output tokens per second, ms per step, the tokens) of one `generate` with up to
    `num_micro_batches` steps in flight."""
    core = llm.engine_core
    core.set_num_micro_batches(num_micro_batches)
    num_steps = core.runner.num_steps
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    num_steps = core.runner.num_steps - num_steps
    return sum(map(len, tokens)) / elapsed, elapsed / num_steps * 1000, tokens


def _engine_rounds(llm, args) -> str:
    """Paired rounds of the engine's generate with pipeline_parallel_size micro-batches, and with one."""
    from xlaserve.sampling_params import SamplingParams

    rng = np.random.default_rng(0)
    vocab = llm.engine_core.runner.model_config.vocab_size
    prompts = [
        {"prompt_token_ids": rng.integers(10, vocab, args.prompt_tokens).tolist()}
        for _ in range(args.requests)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    pp = args.pipeline_parallel_size
    for num in (pp, 1):  # compiles each mode's buckets (a micro-batch runs fewer sequences)
        _generate(llm, prompts, params, num)
    llm.engine_core.peak_steps_in_flight = 0
    many, one, same = [], [], True
    for _ in range(args.rounds):
        many.append(_generate(llm, prompts, params, pp))
        one.append(_generate(llm, prompts, params, 1))
        same = same and many[-1][2] == one[-1][2]
    ratios = sorted(a[0] / b[0] for a, b in zip(many, one))
    return (
        f"engine, {args.requests} requests of {args.prompt_tokens} prompt + {args.output_tokens} output "
        f"tokens: {pp} micro-batches in flight (peak {llm.engine_core.peak_steps_in_flight}) "
        f"{statistics.median(a[0] for a in many):.1f} tok/s, {statistics.median(a[1] for a in many):.1f} "
        f"ms/step; 1 in flight {statistics.median(b[0] for b in one):.1f} tok/s, "
        f"{statistics.median(b[1] for b in one):.1f} ms/step: {statistics.median(ratios):.2f}x "
        f"(rounds {ratios[0]:.2f}-{ratios[-1]:.2f}x); same tokens: {'yes' if same else 'NO'}"
    )


def main(argv: list[str] | None = None) -> int:
    from xlaserve.entrypoints.llm import LLM

    parser = argparse.ArgumentParser(prog="python -m xlaserve.entrypoints.bench.pipeline")
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256, help="the micro-batch's token bucket")
    parser.add_argument("--micro-batches", type=int, default=8, help="per mode and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=8, help="the engine's requests (0: skip it)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        pipeline_parallel_size=args.pipeline_parallel_size,
        max_model_len=max(512, args.tokens),
        max_num_batched_tokens=args.tokens,
        max_num_seqs=max(8, args.requests),
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
    if args.requests:
        print(_engine_rounds(llm, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
