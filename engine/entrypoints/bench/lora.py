"""`xlaserve bench throughput --num-random-loras N` (or `--lora-modules ...`): the same workload on
the base model, then spread over the adapters, in one process; reports both and their ratio.

The base run uses an engine without LoRA (the program a user without adapters gets); the LoRA run an
engine with `--enable-lora` whose requests take the adapters in turn. Random adapters target every
projection of every layer (the most work per token) at `--random-lora-rank`; they are written as
PEFT directories, so they go through the same loader as a user's.
"""

from __future__ import annotations

import gc
import json
import os
import tempfile

from xlaserve.entrypoints.arg_utils import parse_lora_modules
from xlaserve.lora_request import LoRARequest


def write_random_adapters(runner, num: int, rank: int, directory: str, seed: int = 0) -> list[LoRARequest]:
    """`num` PEFT adapters of rank `rank` on every projection the engine's slots cover."""
    import numpy as np  # not at the top: the CLI imports this module without numpy installed
    from safetensors.numpy import save_file

    manager = runner.lora
    rng = np.random.default_rng(seed)
    loras = []
    for i in range(num):
        path = os.path.join(directory, f"random-lora-{i}")
        os.makedirs(path, exist_ok=True)
        tensors, targets = {}, set()
        for stack, modules in manager.layout.items():
            start = manager.layer_stacks[stack].start
            for module, (num_layers, din, dout) in modules.items():
                targets.add(module.rsplit(".", 1)[-1])
                for layer in range(num_layers):
                    prefix = f"base_model.model.model.layers.{start + layer}.{module}"
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
    """{"base": report, "lora": report, "ratio_output_throughput": lora / base, ...}; `engines`: [an
    engine built with `without_lora(engine_args)`], popped and released after its run, so that the
    two engines are never in memory together."""
    from xlaserve.entrypoints.llm import LLM

    modules = parse_lora_modules(args.lora_modules)
    num = len(modules) or args.num_random_loras
    rank = args.random_lora_rank if not modules else (engine_args.get("max_lora_rank") or 16)
    base_args = without_lora(engine_args)
    base_llm = engines.pop()
    base = run_xlaserve(base_llm, prompts, args.output_len, batch)
    del base_llm
    gc.collect()
    lora_args = {**base_args, "enable_lora": True, "max_loras": engine_args.get("max_loras") or num}
    lora_args["max_lora_rank"] = max(rank, engine_args.get("max_lora_rank") or rank)
    llm = LLM(args.model, **lora_args)
    runner = llm.engine_core.runner
    with tempfile.TemporaryDirectory(prefix="xlaserve-bench-lora-") as directory:
        if modules:
            loras = [LoRARequest(m["name"], i + 1, m["path"]) for i, m in enumerate(modules)]
        else:
            loras = write_random_adapters(runner, num, rank, directory)
        per_prompt = [loras[i % len(loras)] for i in range(len(prompts))]
        lora = run_xlaserve(llm, prompts, args.output_len, batch, lora_requests=per_prompt)
    return {
        "num_loras": len(loras),
        "lora_rank": rank,
        "max_loras": lora_args["max_loras"],
        "base": base,
        "lora": lora,
        "ratio_output_throughput": lora["output_tokens_per_s"] / base["output_tokens_per_s"],
        "compiles_after_warm_up": runner.guard.num_unexpected,
        "adapter_loads": runner.lora.num_loads,
    }


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
        f"{r['ratio_output_throughput']:.2f}x the base model's output throughput; "
        f"{r['compiles_after_warm_up']} compiles after warm-up, {r['adapter_loads']} adapter loads"
    )
