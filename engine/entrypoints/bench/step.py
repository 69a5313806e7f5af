"""`python -m xlaserve.entrypoints.bench.step`: where one real decode step's time goes.

The bench's chat workload runs (`--num-prompts` at once, synchronously) until a step decodes one token
for every prompt; that step's inputs (`ModelRunner.prepare`'s) are kept and the step is replayed on the
device: the forward alone, the sampler alone, the whole step (`runner.run`), medians of `--repeats`.
With `--trace DIR` the replays also run under `jax.profiler` and the report sums the trace's events by
name (XLA's thunks: `ynn_fusion` dots, copies, the attention op...), per step. Replaying one step keeps
the machine's state out of it (no scheduler, no new prompts): what a decode step costs on this device
at this batch, to compare engine settings (`--no-batch-invariant`) or code changes; engine/PERFORMANCE.md
"bench targets and the step, stop 54" was measured with it.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import statistics
import time

import jax


def capture_decode_step(llm, num_prompts: int, output_len: int = 16):
    """Run the chat workload's first `num_prompts` prompts; the inputs of a step that decodes one token
    for each of them (the last such step), or None if none did."""
    from xlaserve.entrypoints.bench.offline import _prompts, workload
    from xlaserve.sampling_params import SamplingParams

    runner = llm.engine_core.runner
    captured = {}
    prepare = runner.prepare

    def keep(scheduled, *args, **kwargs):
        inputs = prepare(scheduled, *args, **kwargs)
        if len(scheduled) == num_prompts and all(s.num_new_tokens == 1 for s in scheduled):
            captured["inputs"] = inputs
        return inputs

    runner.prepare = keep
    try:
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        llm.generate(_prompts(llm.tokenizer, workload(num_prompts)), params, use_tqdm=False)
    finally:
        runner.prepare = prepare
    return captured.get("inputs")


def _median_ms(fn, repeats: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def replay(runner, inputs, repeats: int) -> dict:
    """ms of the captured step's forward, sampler and whole step, medians of `repeats`."""
    ready = runner.placement.step_inputs
    batch, sampling = ready(inputs.batch), ready(inputs.sampling)

    def forward():
        return runner._run_forward(batch, inputs.hooks)[1]

    hidden_rd = forward()

    def sample():
        out, runner.last_sampled = runner._sample_fn(
            runner.head_params, hidden_rd, sampling, with_logprobs=inputs.with_logprobs
        )
        return out.token_ids

    return {
        "num_tokens": int(inputs.batch.input_ids.shape[0]),
        "forward_ms": _median_ms(forward, repeats),
        "sample_ms": _median_ms(sample, repeats),
        "step_ms": _median_ms(lambda: runner.run(inputs), repeats),
    }


def trace_events(trace_dir: str, num_steps: int, top: int) -> list[dict]:
    """The trace's complete events summed by name: [{name, ms_per_step, calls_per_step}], largest first."""
    path = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    total, calls = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X":
            total[e["name"]] += e["dur"]
            calls[e["name"]] += 1
    return [
        {"name": name, "ms_per_step": us / 1e3 / num_steps, "calls_per_step": calls[name] / num_steps}
        for name, us in total.most_common(top)
    ]


def main(argv: list[str] | None = None) -> int:
    from xlaserve.entrypoints.llm import LLM

    parser = argparse.ArgumentParser(prog="python -m xlaserve.entrypoints.bench.step")
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=64, help="the decode step's batch")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--enforce-eager", action="store_true", help="compile only the buckets used")
    parser.add_argument("--trace", default=None, help="a folder: also profile the replays, summed by event")
    parser.add_argument("--top", type=int, default=30, help="events listed from the trace")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)

    kwargs = {"dtype": args.dtype, "max_num_seqs": max(args.num_prompts, 1), "async_scheduling": False}
    if args.batch_invariant is not None:
        kwargs["batch_invariant"] = args.batch_invariant
    if args.max_model_len is not None:
        kwargs["max_model_len"] = args.max_model_len
    if args.enforce_eager:
        kwargs["enforce_eager"] = True
    llm = LLM(args.model, **kwargs)
    try:
        runner = llm.engine_core.runner
        inputs = capture_decode_step(llm, args.num_prompts)
        if inputs is None:
            raise SystemExit(f"no step decoded all {args.num_prompts} prompts at once (max_num_seqs?)")
        report = {
            "num_prompts": args.num_prompts,
            "dtype": str(runner.dtype),
            "batch_invariant": llm.config.model.batch_invariant,
        } | replay(runner, inputs, args.repeats)
        if args.trace:
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = 0
            jax.profiler.start_trace(args.trace, create_perfetto_trace=True, profiler_options=options)
            for _ in range(args.repeats):
                jax.block_until_ready(runner.run(inputs))
            jax.profiler.stop_trace()
            report["events"] = trace_events(args.trace, args.repeats, args.top)
    finally:
        llm.shutdown()
    print(
        f"decode step of {report['num_prompts']} prompts ({report['dtype']}, batch invariance "
        f"{'on' if report['batch_invariant'] else 'off'}): forward {report['forward_ms']:.2f} ms, sampler "
        f"{report['sample_ms']:.2f} ms, whole step {report['step_ms']:.2f} ms"
    )
    for e in report.get("events", []):
        print(f"{e['ms_per_step']:9.2f} ms {e['calls_per_step']:7.1f}x  {e['name'][:100]}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
