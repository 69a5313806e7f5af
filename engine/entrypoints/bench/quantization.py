"""Paired benchmark of the quantization modes in one process (engine/PERFORMANCE.md):

    python -m xlaserve.entrypoints.bench.quantization [--rounds 3] [--output-len 32]

Builds one engine per mode (bfloat16, int8 and fp8 weights, an fp8 KV cache, the GGUF's own blocks
kept) on the embedded SmolLM2, then runs the rounds interleaved (each round: every mode's batch-1
latency, then its batched throughput), so that load from other processes falls on every mode
alike; reports medians over the rounds after the first (which compiles), weight bytes and KV
blocks, and the load average.
"""

from __future__ import annotations

import argparse
import json
import statistics

from xlaserve.entrypoints.bench.offline import _prompts, run_xlaserve, workload

MODES = {
    "bfloat16": {},
    "int8": {"quantization": "int8"},
    "fp8": {"quantization": "fp8"},
    "fp8 KV cache": {"kv_cache_dtype": "fp8"},
    "gguf": {"quantization": "gguf"},  # the GGUF's Q4_1 blocks packed, its Q8_0 table kept
}


def main(argv: list[str] | None = None) -> int:
    from xlaserve.entrypoints.llm import LLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=int, default=64 * 2**20)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {list(MODES)}")
    args = parser.parse_args(argv)
    modes = {name: MODES[name] for name in ["bfloat16", *args.modes.split(",")]}
    engines = {
        name: LLM(
            dtype="bfloat16",
            max_model_len=1024,
            max_num_seqs=args.num_prompts,
            max_num_batched_tokens=256,
            kv_cache_memory=args.kv_cache_memory,
            enforce_eager=True,  # the first round compiles what the runs use
            **extra,
        )
        for name, extra in modes.items()
    }
    prompts = _prompts(engines["bfloat16"].tokenizer, workload(args.num_prompts))
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in modes}
    for _ in range(args.rounds + 1):
        for name, llm in engines.items():
            latency = run_xlaserve(llm, prompts[:2], args.output_len, batch=False)
            throughput = run_xlaserve(llm, prompts, args.output_len, batch=True)
            runs[name].append((latency["tpot_s"]["p50"], throughput["output_tokens_per_s"]))
    results = {}
    for name, llm in engines.items():
        measured = runs[name][1:]
        runner = llm.engine_core.runner
        results[name] = {
            "tpot_ms_batch1": statistics.median(t for t, _ in measured) * 1e3,
            "output_tokens_per_s": statistics.median(r for _, r in measured),
            "weight_bytes": runner.weight_bytes,
            "num_kv_blocks": runner.num_blocks,
        }
    base = results["bfloat16"]
    for name, r in results.items():
        tpot, rate, weights = r["tpot_ms_batch1"], r["output_tokens_per_s"], r["weight_bytes"]
        print(
            f"{name:>13}: TPOT {tpot:6.1f} ms ({tpot / base['tpot_ms_batch1']:.2f}x), "
            f"{rate:6.1f} tok/s ({rate / base['output_tokens_per_s']:.2f}x), "
            f"weights {weights / 2**20:.1f} MiB ({weights / base['weight_bytes']:.2f}x), "
            f"{r['num_kv_blocks']} KV blocks"
        )
    with open("/proc/loadavg") as f:
        print("load average:", " ".join(f.read().split()[:3]))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
