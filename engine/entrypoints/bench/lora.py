"""`xlaserve bench throughput --num-random-loras N` (or `--lora-modules ...`): the same workload on
the base model and spread over the adapters, paired in one process; reports both and their ratio.

The base runs use an engine without LoRA (the program a user without adapters gets); the LoRA runs an
engine with `--enable-lora` whose requests take the adapters in turn. Both engines stay built, and
`--lora-rounds` rounds alternate them (the order turning each round) so that a machine whose load
drifts weighs on both alike; the report takes the medians and the median of the rounds'
ratios. With `--lora-rounds 1` the base engine runs once and is released before the LoRA engine is
built (for a model too large to hold twice). Random adapters target every projection of every layer
(the most work per token) at `--random-lora-rank` (a list such as 8,16: the adapters take the ranks
in turn); they are written as PEFT directories, so they go through the same loader as a user's.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import tempfile

from xlaserve.entrypoints.arg_utils import parse_lora_modules
from xlaserve.lora_request import LoRARequest


def parse_ranks(text: str | list[int]) -> list[int]:
    """`--random-lora-rank`: one rank or a comma-separated list ("8,16")."""
    if isinstance(text, list):
        return text
    ranks = [int(r) for r in str(text).split(",") if r.strip()]
    if not ranks or min(ranks) < 1:
        raise ValueError(f"--random-lora-rank: positive integers separated by commas, got {text!r}")
    return ranks


def write_random_adapters(
    runner, num: int, rank: int | list[int], directory: str, seed: int = 0
) -> list[LoRARequest]:
    """`num` PEFT adapters on every projection the engine's slots cover; adapter i has rank
    `rank[i % len(rank)]` (or `rank`)."""
    import numpy as np  # not at the top: the CLI imports this module without numpy installed
    from safetensors.numpy import save_file

    manager = runner.lora
    rng = np.random.default_rng(seed)
    ranks = rank if isinstance(rank, list) else [rank]
    loras = []
    for i in range(num):
        rank = ranks[i % len(ranks)]
        path = os.path.join(directory, f"random-lora-{i}")
        os.makedirs(path, exist_ok=True)
        tensors, targets = {}, set()
        for stack, modules in manager.layout.items():
            layer_ids = manager.layer_stacks[stack]
            for module, (num_layers, din, dout) in modules.items():
                targets.add(module.rsplit(".", 1)[-1])
                for layer in range(num_layers):
                    prefix = f"base_model.model.model.layers.{layer_ids[layer]}.{module}"
                    tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, 0.02, (rank, din)).astype(np.float32)
                    tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.02, (dout, rank)).astype(np.float32)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(
                {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(targets)}, f
            )
        loras.append(LoRARequest(f"random-lora-{i}", i + 1, path))
    return loras


LORA_ARGS = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")


def is_lora_bench(args) -> bool:
    return bool(getattr(args, "num_random_loras", 0) or getattr(args, "lora_modules", None))


def without_lora(engine_args: dict) -> dict:
    return {k: v for k, v in engine_args.items() if k not in LORA_ARGS}


def bench_lora(args, engine_args: dict, prompts, run_xlaserve, batch: bool, engines: list) -> dict:
    """{"base": report, "lora": report, "ratio_output_throughput": lora / base, "rounds": [...]};
    `engines`: [an engine built with `without_lora(engine_args)`]. With --lora-rounds N both engines
    are kept and run alternately N times; the reports are the rounds' medians."""
    from xlaserve.entrypoints.llm import LLM
    from xlaserve.sampling_params import SamplingParams

    modules = parse_lora_modules(args.lora_modules)
    num = len(modules) or args.num_random_loras
    ranks = parse_ranks(args.random_lora_rank) if not modules else [engine_args.get("max_lora_rank") or 16]
    base_args = without_lora(engine_args)
    base_llm = engines.pop()
    num_rounds = max(1, getattr(args, "lora_rounds", 1) or 1)
    base_guard = base_llm.engine_core.runner.guard
    first_base = None
    if num_rounds == 1:  # no pairing: run the base engine and release it before the LoRA one is built
        first_base = run_xlaserve(base_llm, prompts, args.output_len, batch)
        base_llm = None
        gc.collect()
    lora_args = {**base_args, "enable_lora": True, "max_loras": engine_args.get("max_loras") or num}
    lora_args["max_lora_rank"] = max(max(ranks), engine_args.get("max_lora_rank") or 0)
    llm = LLM(args.model, **lora_args)
    runner = llm.engine_core.runner
    rounds = []
    with tempfile.TemporaryDirectory(prefix="xlaserve-bench-lora-") as directory:
        if modules:
            loras = [LoRARequest(m["name"], i + 1, m["path"]) for i, m in enumerate(modules)]
        else:
            loras = write_random_adapters(runner, num, ranks, directory)
        per_prompt = [loras[i % len(loras)] for i in range(len(prompts))]
        touch = SamplingParams(temperature=0.0, max_tokens=2)
        llm.generate(prompts[: len(loras)], touch, use_tqdm=False, lora_request=per_prompt[: len(loras)])
        for i in range(num_rounds):
            runs = {}
            # The order turns every round, so that drifting load weighs on every run alike. The third
            # run: the LoRA engine serving only the base model (what enabling LoRA costs steps
            # without adapters).
            order = ["base", "lora", "lora_engine_base"]
            for name in order[i % 3 :] + order[: i % 3]:
                if name == "base":
                    runs[name] = first_base or run_xlaserve(base_llm, prompts, args.output_len, batch)
                elif name == "lora":
                    runs[name] = run_xlaserve(llm, prompts, args.output_len, batch, lora_requests=per_prompt)
                else:
                    runs[name] = run_xlaserve(llm, prompts, args.output_len, batch)
            runs["ratio"] = runs["lora"]["output_tokens_per_s"] / runs["base"]["output_tokens_per_s"]
            runs["ratio_lora_engine_base"] = (
                runs["lora_engine_base"]["output_tokens_per_s"] / runs["base"]["output_tokens_per_s"]
            )
            rounds.append(runs)
    base, lora, lora_engine_base = (
        _median_report([r[name] for r in rounds]) for name in ("base", "lora", "lora_engine_base")
    )
    return {
        "num_loras": len(loras),
        "lora_rank": ranks if len(ranks) > 1 else ranks[0],
        "max_loras": lora_args["max_loras"],
        "num_rounds": num_rounds,
        "base": base,
        "lora": lora,
        "lora_engine_base": lora_engine_base,
        "round_ratios": [r["ratio"] for r in rounds],
        "round_ratios_lora_engine_base": [r["ratio_lora_engine_base"] for r in rounds],
        "ratio_lora_engine_base": statistics.median(r["ratio_lora_engine_base"] for r in rounds),
        "ratio_output_throughput": statistics.median(r["ratio"] for r in rounds),
        "compiles_after_warm_up": runner.guard.num_unexpected + base_guard.num_unexpected,
        "adapter_loads": runner.lora.num_loads,
    }


def _median_report(reports: list[dict]) -> dict:
    """The run with the median output throughput (a whole report, so its fields stay consistent)."""
    ordered = sorted(reports, key=lambda r: r["output_tokens_per_s"])
    return ordered[(len(ordered) - 1) // 2] if len(ordered) % 2 else ordered[len(ordered) // 2 - 1]


def print_lora(results: dict) -> None:
    r = results["lora_bench"]
    for name in ("base", "lora"):
        x = r[name]
        print(
            f"{name:>5}: {x['output_tokens_per_s']:.1f} output tok/s, "
            f"TPOT mean {x['tpot_s']['mean'] * 1e3:.1f} ms, {x['num_steps']} steps"
        )
    print(
        f"{r['num_loras']} adapters of rank {r['lora_rank']} (max_loras={r['max_loras']}): "
        f"{r['ratio_output_throughput']:.2f}x the base model's output throughput (median of "
        f"{r['num_rounds']} paired rounds: {', '.join(f'{x:.2f}' for x in r['round_ratios'])}); "
        f"{r['compiles_after_warm_up']} compiles after warm-up, {r['adapter_loads']} adapter loads"
    )
    print(
        f"the LoRA engine with no adapter in use: {r['ratio_lora_engine_base']:.2f}x the base engine's "
        "output throughput (median)"
    )
