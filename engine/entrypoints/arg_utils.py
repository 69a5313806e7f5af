"""Engine arguments, defined once: vLLM's flag names, mapped onto `EngineConfig.from_kwargs`.

Every command that builds an engine (generate, chat, serve, bench) takes these flags from here.
"""

from __future__ import annotations

import argparse
import json
import os

from xlaserve.config import EngineConfig
from xlaserve.entrypoints.openai.reasoning import get_reasoning_parser
from xlaserve.entrypoints.openai.tool_parsers import default_tool_parser, get_tool_parser


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
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule step N+1 while the device runs step N (default: on where supported)",
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
    g.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 1, "prompt_lookup_max": 4} (engine/SPEC_DECODE.md)',
    )
    lo = parser.add_argument_group("LoRA")
    lo.add_argument("--enable-lora", action="store_true", default=None, help="serve LoRA adapters")
    lo.add_argument(
        "--max-loras", type=int, default=None, help="adapters in one step (device slots; default 1)"
    )
    lo.add_argument("--max-lora-rank", type=int, default=None, help="the largest adapter rank (default 16)")
    lo.add_argument(
        "--max-cpu-loras", type=int, default=None, help="adapters kept in host memory (default: max-loras)"
    )
    lo.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help='adapters served from the start: name=path, or JSON {"name": ..., "path": ..., '
        '"base_model_name": ...}; a request picks one by its "model"',
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
    "async_scheduling",
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
    "speculative_config",
    "tensor_parallel_size",
    "data_parallel_size",
    "enable_expert_parallel",
    "nnodes",
    "node_rank",
    "master_addr",
    "master_port",
    "enable_lora",
    "max_loras",
    "max_lora_rank",
    "max_cpu_loras",
)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine arguments the user set (unset ones keep the config defaults)."""
    kwargs = {k: getattr(args, k) for k in _ENGINE_KEYS if getattr(args, k, None) is not None}
    EngineConfig.from_kwargs(args.model, **kwargs)  # validate before loading anything
    return kwargs


def parse_lora_modules(values: list[str] | None) -> list[dict]:
    """--lora-modules entries (vLLM's forms: `name=path`, or a JSON object with name, path and
    optionally base_model_name) as {"name", "path", "base_model_name"} dicts."""
    modules = []
    for value in values or []:
        if value.lstrip().startswith("{"):
            try:
                entry = json.loads(value)
            except ValueError as e:
                raise ValueError(f"--lora-modules: {value!r} is not valid JSON ({e})") from None
            if (
                not isinstance(entry, dict)
                or not {"name", "path"} <= set(entry)
                or set(entry)
                - {
                    "name",
                    "path",
                    "base_model_name",
                }
            ):
                raise ValueError(
                    f"--lora-modules: {value!r} must be an object with name, path and optionally "
                    "base_model_name"
                )
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: {value!r} is neither name=path nor a JSON object")
            entry = {"name": name, "path": path}
        modules.append({"base_model_name": None, **entry})
    return modules


def run_follower_if_needed(args: argparse.Namespace) -> bool:
    """On node_rank > 0 of a multi-host engine, serve process 0's steps instead of the command."""
    if not getattr(args, "node_rank", None):
        return False
    from xlaserve.entrypoints.llm import serve_follower  # jax and the model code: only when needed

    serve_follower(args.model, **engine_kwargs(args))
    return True


def add_tool_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's server flags for tool calling and reasoning models (`xlaserve serve`)."""
    g = parser.add_argument_group("tools and reasoning")
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide when to call tools (tool_choice "auto"); its calls are read by '
        "--tool-call-parser",
    )
    g.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="how the model writes tool calls: hermes, llama3_json, mistral (default: from the model family)",
    )
    g.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help="split a reasoning model's thinking into reasoning_content: deepseek_r1, qwen3",
    )


def _model_type(model: str | None) -> str | None:
    """The HF model_type of a model directory (None for GGUF files and the embedded model)."""
    path = os.path.join(model, "config.json") if model and os.path.isdir(model) else None
    if path is None or not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f).get("model_type")


def tool_options(args: argparse.Namespace) -> dict:
    """The flags of `add_tool_args` as ServerState fields (parser classes); ValueError on a bad name."""
    name = args.tool_call_parser
    if name is None and args.enable_auto_tool_choice:
        name = default_tool_parser(_model_type(args.model))
        if name is None:
            raise ValueError(
                "--enable-auto-tool-choice needs --tool-call-parser: this model's family has no default"
            )
    return {
        "enable_auto_tool_choice": args.enable_auto_tool_choice,
        "tool_parser_cls": get_tool_parser(name) if name is not None else None,
        "reasoning_parser_cls": get_reasoning_parser(args.reasoning_parser)
        if args.reasoning_parser
        else None,
    }
