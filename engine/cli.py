"""The `xlaserve` command: generate, chat, serve, bench."""

from __future__ import annotations

import argparse
import logging
import sys

from engine.config import EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's engine flag names; defaults come from the config dataclasses."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF directory, .gguf file, or 'smollm2' (the default)")
    g.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--load-format", default=None, choices=["auto", "dummy"],
                   help="dummy: random weights; config and tokenizer from the --model directory (benchmarks)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None, help="(default: on)"
    )
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=None)
    g.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache budget in bytes (CPU)")
    g.add_argument("--scheduling-policy", default=None, choices=["fcfs", "priority"])
    g.add_argument(
        "--attention-backend", default=None, choices=["auto", "reference", "pallas", "jax-triton"],
        help="also XLASERVE_ATTENTION_BACKEND",
    )
    g.add_argument("--compilation-cache-dir", default=None, help="persistent XLA compilation cache")
    g.add_argument("--enforce-eager", action="store_true", default=None, help="skip warm-up compiles")
    g.add_argument("--strict-compile-guard", action="store_true", default=None,
                   help="fail a step that compiles after warm-up (default: warn)")
    p = parser.add_argument_group("parallelism")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=None)
    p.add_argument("--enable-expert-parallel", action="store_true", default=None)
    p.add_argument("--nnodes", type=int, default=None, help="processes (hosts) of a multi-host engine")
    p.add_argument("--node-rank", type=int, default=None, help="this process's rank; 0 runs the front end")
    p.add_argument("--master-addr", default=None, help="address of process 0 (jax.distributed coordinator)")
    p.add_argument("--master-port", type=int, default=None, help="coordinator port; the step channel uses +1")


_ENGINE_KEYS = (
    "dtype", "load_format", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "enable_prefix_caching",
    "seed", "gpu_memory_utilization", "kv_cache_memory", "scheduling_policy", "attention_backend",
    "compilation_cache_dir", "enforce_eager", "strict_compile_guard", "tensor_parallel_size",
    "data_parallel_size", "enable_expert_parallel", "nnodes", "node_rank", "master_addr", "master_port",
)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine arguments the user set (unset ones keep the config defaults)."""
    kwargs = {k: getattr(args, k) for k in _ENGINE_KEYS if getattr(args, k, None) is not None}
    EngineConfig.from_kwargs(args.model, **kwargs)  # validate before loading anything
    return kwargs


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, dest="sampling_seed")
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--stop", action="append", default=None)


def sampling_params(args: argparse.Namespace):
    from engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.sampling_seed, repetition_penalty=args.repetition_penalty, stop=args.stop,
    )


def run_follower_if_needed(args: argparse.Namespace) -> bool:
    """On node_rank > 0 of a multi-host engine, serve process 0's steps instead of the command."""
    if not getattr(args, "node_rank", None):
        return False
    from engine.llm import serve_follower

    serve_follower(args.model, **engine_kwargs(args))
    return True


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.llm import LLM

    if run_follower_if_needed(args):
        return 0
    llm = LLM(args.model, **engine_kwargs(args))
    params = sampling_params(args)
    prompt = args.prompt
    if not args.raw:
        text = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        prompt = {"prompt": text, "prompt_token_ids": llm.tokenizer.encode(text, add_special_tokens=False)}
    for delta in llm.stream(prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    llm.shutdown()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from engine.llm import LLM

    llm = LLM(args.model, **engine_kwargs(args))
    params = sampling_params(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("xlaserve chat: type a message, Ctrl-D or /exit to leave, /reset to start over.")
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = {"prompt": text, "prompt_token_ids": llm.tokenizer.encode(text, add_special_tokens=False)}
        reply = []
        for delta in llm.stream(prompt, params):
            reply.append(delta)
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})


def cmd_convert(args: argparse.Namespace) -> int:
    from models.convert import convert_checkpoint

    dtype = convert_checkpoint(args.model, args.out_dir, args.dtype)
    print(f"wrote {args.out_dir} ({dtype}); serve it with --model {args.out_dir}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xlaserve", description="LLM inference on JAX/XLA")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="complete one prompt, streaming the text to stdout")
    p.add_argument("prompt")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="an interactive chat on the terminal")
    p.add_argument("--system", default=None, help="a system prompt")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser(
        "convert", help="write MODEL's parameters in our layout with orbax, for faster loading"
    )
    p.add_argument("model", help="HF directory, .gguf file, converted directory, or 'smollm2'")
    p.add_argument("out_dir", help="where to write params/, config.json and the tokenizer")
    p.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16", "float16"],
        help="(default: the checkpoint's own floating dtype; float32 for GGUF)",
    )
    p.set_defaults(func=cmd_convert)

    from engine import bench
    from engine.server import launcher

    launcher.add_parser(sub, add_engine_args)
    bench.add_parser(sub, add_engine_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
