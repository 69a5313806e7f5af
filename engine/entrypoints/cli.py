"""The `xlaserve` command: generate, chat, convert, serve, run-batch, router, bench."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from xlaserve.engine.host_memory import keep_host_memory
from xlaserve.entrypoints.arg_utils import add_engine_args, engine_kwargs, run_follower_if_needed

# generate's and chat's sampling where neither the flag nor the model's generation config says.
_SAMPLING_DEFAULTS = {"max_tokens": 256, "temperature": 0.7, "top_p": 1.0, "top_k": 0, "min_p": 0.0}


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling (unset: the model's generation config, else as shown)")
    for name, value in _SAMPLING_DEFAULTS.items():
        g.add_argument(
            f"--{name.replace('_', '-')}", type=type(value), default=None, help=f"(default {value})"
        )
    g.add_argument("--sampling-seed", type=int, default=None, dest="sampling_seed")
    g.add_argument("--repetition-penalty", type=float, default=None, help="(default 1.0)")
    g.add_argument("--stop", action="append", default=None)


def sampling_params(args: argparse.Namespace, model_defaults: dict):
    """The flags given, over the model's generation config (LLM.default_sampling), over
    _SAMPLING_DEFAULTS."""
    from xlaserve.sampling_params import SamplingParams

    given = {name: getattr(args, name) for name in (*_SAMPLING_DEFAULTS, "repetition_penalty")}
    given = {name: value for name, value in given.items() if value is not None}
    fields = {**_SAMPLING_DEFAULTS, **model_defaults, **given}
    return SamplingParams(**fields, seed=args.sampling_seed, stop=args.stop)


def require_tokenizer(args: argparse.Namespace) -> None:
    """generate and chat read and write text: refuse --skip-tokenizer-init before loading anything."""
    if args.skip_tokenizer_init:
        raise ValueError(
            f"--skip-tokenizer-init: `xlaserve {args.command}` reads and writes text, so it needs the "
            "tokenizer (serve the model with --skip-tokenizer-init to send token ids instead)"
        )


# `generate` and `chat` run one request at a time. Unless the user sizes the engine, it is sized to
# that: one sequence and steps of at most 128 tokens (longer prompts prefill in chunks) compile 16
# programs instead of 36 for the server's defaults, which halves a cold start and cuts a warm one by a
# third (engine/PERFORMANCE.md, "Start-up").
ONE_REQUEST_DEFAULTS = {"max_num_seqs": 1, "max_num_batched_tokens": 128}


def one_request_engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = engine_kwargs(args)
    for key, value in ONE_REQUEST_DEFAULTS.items():
        kwargs.setdefault(key, max(value, kwargs.get("max_num_seqs", 1)))
    return kwargs


logger = logging.getLogger(__name__)

# Set by a one-shot `generate` on one host once its text is out and its engine shut down: the console
# script (`run`) then leaves without the interpreter's teardown (module and XLA client teardown, ~0.7 s
# of a warm `xlaserve generate`'s ~6 s, measured here). Never from `main` itself: a caller in Python
# keeps its process.
_exit_without_teardown = False


def cmd_generate(args: argparse.Namespace) -> int:
    from xlaserve.entrypoints.llm import LLM

    imported = time.perf_counter()  # jax, flax and transformers come in with the offline LLM
    require_tokenizer(args)
    kwargs = one_request_engine_kwargs(args)
    if run_follower_if_needed(args, kwargs):  # the follower's engine sized as process 0's
        return 0
    llm = LLM(args.model, **kwargs)
    ready = time.perf_counter()
    params = sampling_params(args, llm.default_sampling)
    prompt = args.prompt
    if not args.raw:
        text = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        prompt = {"prompt": text, "prompt_token_ids": llm.tokenizer.encode(text, add_special_tokens=False)}
    first_token = None
    for delta in llm.stream(prompt, params):
        first_token = first_token or time.perf_counter()
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    first_token = first_token or time.perf_counter()  # nothing generated: the end stands for it
    # The start's phases not in the engine's own start-up line (`xlaserve bench startup` reads both).
    logger.info(
        "start-up: imports %.1fs, first token %.2fs after the engine was ready, %.1fs after the start",
        imported - args.started_at,
        first_token - ready,
        first_token - args.started_at,
    )
    llm.shutdown()
    global _exit_without_teardown
    _exit_without_teardown = (args.nnodes or 1) == 1  # a multi-host leader shuts jax.distributed down
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from xlaserve.entrypoints.llm import LLM

    require_tokenizer(args)
    kwargs = one_request_engine_kwargs(args)
    if run_follower_if_needed(args, kwargs):  # node_rank > 0: process 0 holds the conversation
        return 0
    llm = LLM(args.model, **kwargs)
    params = sampling_params(args, llm.default_sampling)
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
    from xlaserve.models.convert import convert_checkpoint

    dtype = convert_checkpoint(args.model, args.out_dir, args.dtype)
    print(f"wrote {args.out_dir} ({dtype}); serve it with --model {args.out_dir}")
    return 0


def cmd_bench_attention(args: argparse.Namespace) -> int:
    from xlaserve.entrypoints.bench import attention  # jax and the kernels: only for this command

    return attention.main(args.attention_args, prog="xlaserve bench attention")


def add_bench_attention_parser(bench_sub) -> None:
    """`xlaserve bench attention [FLAGS]`: FLAGS go as they are to the attention bench's own parser, so
    the CLI's start does not import jax to declare them (no prefix chars: `--quick` is an argument)."""
    b = bench_sub.add_parser(
        "attention",
        help="check the attention kernels against the reference on this device and time them "
        "(flags: `xlaserve bench attention -h`)",
        add_help=False,
        prefix_chars="\0",
    )
    b.add_argument("attention_args", nargs="*")
    b.set_defaults(func=cmd_bench_attention)


def build_parser() -> argparse.ArgumentParser:
    # The other commands' modules are imported here, not above: the server's engine core process
    # imports this module again (multiprocessing's spawn runs the parent's main module) and needs none.
    from xlaserve.entrypoints import api_server, router, run_batch
    from xlaserve.entrypoints.bench import offline as bench_offline
    from xlaserve.entrypoints.bench import serve as bench_serve
    from xlaserve.entrypoints.bench import startup as bench_startup
    from xlaserve.entrypoints.bench import targets as bench_targets

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
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="(default: the checkpoint's own floating dtype; float32 for GGUF)",
    )
    p.set_defaults(func=cmd_convert)

    api_server.add_parser(sub, add_engine_args)
    run_batch.add_parser(sub, add_engine_args)
    router.add_parser(sub)
    bench_sub = bench_offline.add_parser(sub, add_engine_args)
    bench_serve.add_serve_parser(bench_sub)
    bench_startup.add_startup_parser(bench_sub)
    bench_targets.add_targets_parser(bench_sub, add_engine_args)
    add_bench_attention_parser(bench_sub)
    return parser


def quiet_libraries() -> None:
    """Keep libraries' start-up notices off a user's terminal. transformers, imported for the
    tokenizer, announces "PyTorch was not found..." when torch is absent (xlaserve never needs it)."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def main(argv: list[str] | None = None) -> int:
    started_at = time.perf_counter()
    keep_host_memory()  # first: before anything starts jax's CPU thread pools
    quiet_libraries()
    args = build_parser().parse_args(argv)
    args.started_at = started_at
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run() -> None:
    """The `xlaserve` console script: main(), then the exit (see `_exit_without_teardown`)."""
    code = main()
    if _exit_without_teardown:
        logging.shutdown()  # flushes the log handlers
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
