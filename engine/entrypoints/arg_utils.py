"""Engine arguments, defined once: vLLM's flag names, mapped onto `EngineConfig.from_kwargs`.

Every command that builds an engine (generate, chat, serve, bench) takes these flags from here.
"""

from __future__ import annotations

import argparse

from xlaserve.config import EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's engine flag names; defaults come from the config dataclasses."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF directory, .gguf file, or 'smollm2' (the default)")
    g.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument(
        "--load-format",
        default=None,
        choices=["auto", "dummy"],
        help="dummy: random weights; config and tokenizer from the --model directory (benchmarks)",
    )
    g.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        default=None,
        help="load no tokenizer: prompts must be token ids, outputs carry token ids and no text",
    )
    g.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=["int8", "fp8", "gguf", "compressed-tensors"],
        help="weights kept quantized on the device: int8 or fp8 (per-channel scales, quantized at load); "
        "gguf: a quantized GGUF's own blocks. A checkpoint released quantized needs no flag",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
        help="KV cache storage; fp8: one byte per value, twice the blocks (default: auto, the model's dtype)",
    )
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        help="cap on a prompt's prefill chunk per step, so one long prompt cannot take a whole step "
        "(default: max_num_batched_tokens / 4; 0: no cap)",
    )
    g.add_argument(
        "--max-num-partial-prefills",
        type=int,
        default=None,
        help="prompts prefilled across steps at once (default: 2)",
    )
    g.add_argument(
        "--max-long-partial-prefills",
        type=int,
        default=None,
        help="of those, prompts longer than the threshold (default: 2)",
    )
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None, help="(default: on)"
    )
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=None)
    g.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache budget in bytes (CPU)")
    g.add_argument("--scheduling-policy", default=None, choices=["fcfs", "priority"])
    g.add_argument(
        "--attention-backend",
        default=None,
        choices=["auto", "reference", "pallas", "jax-triton"],
        help="also XLASERVE_ATTENTION_BACKEND",
    )
    g.add_argument(
        "--compilation-cache-dir",
        default=None,
        help="persistent XLA compilation cache (default ~/.cache/xlaserve/xla; XLASERVE_CACHE_ROOT moves it)",
    )
    g.add_argument(
        "--disable-compilation-cache",
        action="store_true",
        default=None,
        help="compile every program at start, caching nothing (also XLASERVE_DISABLE_COMPILATION_CACHE=1)",
    )
    g.add_argument("--compilation-cache-max-size", type=int, default=None, help="bytes (default: 4 GiB)")
    g.add_argument("--enforce-eager", action="store_true", default=None, help="skip warm-up compiles")
    g.add_argument(
        "--strict-compile-guard",
        action="store_true",
        default=None,
        help="fail a step that compiles after warm-up (default: warn)",
    )
    p = parser.add_argument_group("parallelism")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=None)
    p.add_argument("--enable-expert-parallel", action="store_true", default=None)
    p.add_argument("--nnodes", type=int, default=None, help="processes (hosts) of a multi-host engine")
    p.add_argument("--node-rank", type=int, default=None, help="this process's rank; 0 runs the front end")
    p.add_argument("--master-addr", default=None, help="address of process 0 (jax.distributed coordinator)")
    p.add_argument("--master-port", type=int, default=None, help="coordinator port; the step channel uses +1")


_ENGINE_KEYS = (
    "dtype",
    "load_format",
    "skip_tokenizer_init",
    "quantization",
    "kv_cache_dtype",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "long_prefill_token_threshold",
    "max_num_partial_prefills",
    "max_long_partial_prefills",
    "block_size",
    "enable_prefix_caching",
    "seed",
    "gpu_memory_utilization",
    "kv_cache_memory",
    "scheduling_policy",
    "attention_backend",
    "compilation_cache_dir",
    "disable_compilation_cache",
    "compilation_cache_max_size",
    "enforce_eager",
    "strict_compile_guard",
    "tensor_parallel_size",
    "data_parallel_size",
    "enable_expert_parallel",
    "nnodes",
    "node_rank",
    "master_addr",
    "master_port",
)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine arguments the user set (unset ones keep the config defaults)."""
    kwargs = {k: getattr(args, k) for k in _ENGINE_KEYS if getattr(args, k, None) is not None}
    EngineConfig.from_kwargs(args.model, **kwargs)  # validate before loading anything
    return kwargs


def run_follower_if_needed(args: argparse.Namespace) -> bool:
    """On node_rank > 0 of a multi-host engine, serve process 0's steps instead of the command."""
    if not getattr(args, "node_rank", None):
        return False
    from xlaserve.entrypoints.llm import serve_follower  # jax and the model code: only when needed

    serve_follower(args.model, **engine_kwargs(args))
    return True
