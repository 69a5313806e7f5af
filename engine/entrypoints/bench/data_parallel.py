"""`xlaserve bench throughput -dp N --compare-data-parallel`: the same workload on N data-parallel
ranks and on one, paired in one process; reports both and their ratio.

Both engines stay built (the one-rank engine on the first rank's devices) and `--data-parallel-rounds`
rounds alternate them, the order turning each round, so a machine whose load drifts weighs on both
alike; the report takes the median of the rounds' ratios. On CPU the ranks need fake devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=N` before the command): they share the host's
cores, so what DP gains there is the overlap of one rank's host work with another's step, not compute.
"""

from __future__ import annotations

import statistics


def run_paired(llm, single, run, prompts, output_len: int, batch: bool, rounds: int) -> dict:
    """`run(llm, prompts, output_len, batch)` (bench/offline.py's run_xlaserve) alternated on `llm`
    (N ranks) and `single` (one rank) for `rounds` rounds; each run's report and the ratios."""
    runs: dict[str, list[dict]] = {"one_rank": [], "data_parallel": []}
    for i in range(rounds):
        order = [("one_rank", single), ("data_parallel", llm)]
        for name, engine in order if i % 2 == 0 else order[::-1]:
            runs[name].append(run(engine, prompts, output_len, batch))
    ratios = [
        dp["output_tokens_per_s"] / one["output_tokens_per_s"]
        for one, dp in zip(runs["one_rank"], runs["data_parallel"])
    ]
    return runs | {
        "data_parallel_size": len(llm.engine_core.ranks),
        "ratios_output_throughput": ratios,
        "ratio_output_throughput": statistics.median(ratios),
    }


def print_paired(paired: dict) -> None:
    n = paired["data_parallel_size"]

    def line(r: dict) -> str:
        return f"{r['output_tokens_per_s']:.1f} output tok/s (TPOT {r['tpot_s']['mean'] * 1e3:.1f} ms)"

    for i, (one, dp) in enumerate(zip(paired["one_rank"], paired["data_parallel"])):
        ratio = paired["ratios_output_throughput"][i]
        print(f"round {i + 1}: dp=1 {line(one)}, dp={n} {line(dp)}: {ratio:.2f}x")
    print(f"output throughput dp={n} / dp=1 (median of rounds): {paired['ratio_output_throughput']:.2f}x")
