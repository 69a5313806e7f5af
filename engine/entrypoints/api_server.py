"""`xlaserve serve [MODEL]`: start the engine core process, then uvicorn; stop both on SIGINT/SIGTERM.

The port opens only once the engine is warm, so a client that can connect can generate. On a
signal uvicorn stops accepting connections and gives in-flight requests `--shutdown-timeout`
seconds to finish; then the engine core is stopped and the process exits 0.

An engine core that dies is restarted in place; one that dies more than `--max-engine-restarts`
times within `--engine-restart-window` seconds makes the server shut down the same way and exit 1,
for systemd or Kubernetes to see.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from xlaserve.config import EngineConfig
from xlaserve.engine.media import MediaPolicy
from xlaserve.engine.stat_logger import log_stats, log_stats_interval
from xlaserve.entrypoints.arg_utils import (
    auto_tool_choice,
    engine_config,
    parse_lora_modules,
    run_follower_if_needed,
    tool_options,
)
from xlaserve.entrypoints.serve_args import (
    add_serve_args,
    check_ssl_args,
    load_chat_template,
    parse_tool_servers,
)

logger = logging.getLogger("xlaserve.entrypoints.api_server")


def add_parser(sub, add_engine_args) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (flags named as in `vllm serve`)")
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="HF directory, .gguf file or 'smollm2' (default); same as --model",
    )
    add_engine_args(p)
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)


async def _end_after_grace(server, engine, grace_s: float) -> None:
    """Once a signal asked uvicorn to stop, give in-flight requests `grace_s` seconds, then end them
    with an error event, so their connections close cleanly instead of being cancelled."""
    while not server.should_exit:
        await asyncio.sleep(0.1)
    num_in_flight = engine.get_num_unfinished_requests()
    if num_in_flight:
        logger.info("shutting down: %d request(s) in flight get %.0fs to finish", num_in_flight, grace_s)
    deadline = loop_time() + grace_s
    while engine.get_num_unfinished_requests() and loop_time() < deadline:
        await asyncio.sleep(0.1)
    engine.fail_all_requests("the server is shutting down")


async def _exit_when_engine_fails(server, engine) -> None:
    """Stop serving once the engine gave up on its core: a supervisor restarts a process that exits,
    not one that answers 503 forever."""
    await engine.failed.wait()
    logger.error("the engine core cannot be kept alive: shutting down (exit code 1)")
    server.should_exit = True


def loop_time() -> float:
    return asyncio.get_running_loop().time()


def cmd_serve(args: argparse.Namespace) -> int:
    if args.model_tag is not None:
        args.model = args.model_tag
    if run_follower_if_needed(args):  # node_rank > 0 of a multi-host engine: no HTTP, only steps
        return 0
    if args.enable_admin_api and not args.api_key:
        raise ValueError("--enable-admin-api needs --api-key (or XLASERVE_API_KEY): its routes swap weights")
    args.log_stats_interval = log_stats_interval()  # a bad XLASERVE_LOG_STATS_INTERVAL fails at start
    if args.max_stored_responses < 0:
        raise ValueError(f"--max-stored-responses must be >= 0, got {args.max_stored_responses}")
    if args.grpc_port is not None and not 0 < args.grpc_port < 65536:
        raise ValueError(f"--grpc-port must be in [1, 65535], got {args.grpc_port}")
    if args.grpc_port is not None and args.grpc_port == args.port:
        raise ValueError(f"--grpc-port ({args.grpc_port}) must differ from --port")
    if args.grpc_port is not None:
        from xlaserve.entrypoints.grpc.protos import protos_and_services

        protos_and_services()  # a missing grpc extra fails before the engine starts
    args.tool_servers = parse_tool_servers(args.tool_server)
    check_ssl_args(args)
    if args.max_num_queued_reqs is not None and args.max_num_queued_reqs < 0:
        raise ValueError(f"--max-num-queued-reqs must be >= 0, got {args.max_num_queued_reqs}")
    # Built once, here (bad flags fail before anything loads), and sent as it is to the engine core.
    extra = {} if args.max_num_queued_reqs is None else {"max_num_queued_reqs": args.max_num_queued_reqs}
    config = engine_config(args, **extra)
    args.lora_modules = parse_lora_modules(args.lora_modules)
    if args.lora_modules and not config.lora.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    chat_template = load_chat_template(args.chat_template)
    args.tool_options = tool_options(args)  # bad names fail before the engine starts
    logger.info(auto_tool_choice(args).log_line())
    return asyncio.run(_serve(args, config, chat_template))


def lora_registry(config: EngineConfig, lora_modules: list[dict], served_model_names: list[str]):
    """The --lora-modules adapters (None without --enable-lora), checked before the engine starts: a
    bad entry fails at once."""
    if not config.lora.enable_lora:
        return None
    from xlaserve.entrypoints.serving.lora import LoRARegistry

    loras = LoRARegistry(config.lora.max_lora_rank, served_model_names)
    for module in lora_modules:
        loras.add(module["name"], module["path"], module["base_model_name"])
    return loras


async def check_started_engine(engine, loras, reasoning_parser_cls) -> None:
    """What can be checked only once the model is known; on a failure the engine is shut down and the
    ValueError raised."""
    try:
        if loras is not None:  # every --lora-modules adapter's modules must be the model's own
            loras.set_model(*getattr(engine, "lora_slots", (None, None)))
        if reasoning_parser_cls is not None:  # the tokenizer must have the parser's tags as tokens
            reasoning_parser_cls(engine.tokenizer)
    except ValueError:
        await engine.shutdown()
        raise


def request_state(args, engine, served_model_names, chat_template, loras, **fields):
    """The ServerState of the flags `serve` and `run-batch` share (add_request_args, the tool flags), with
    the model's default sampling (said in the log), plus each command's own `fields`."""
    from xlaserve.entrypoints.serving.state import ServerState  # here: fastapi loads with it

    defaults = engine.config.model.sampling_defaults()
    engine.config.model.log_sampling_defaults(defaults)
    media_domains = tuple(d.lower() for d in args.allowed_media_domains)
    return ServerState(
        engine=engine,
        served_model_names=served_model_names,
        chat_template=chat_template,
        trust_request_chat_template=args.trust_request_chat_template,
        chat_template_content_format=args.chat_template_content_format,
        media_policy=MediaPolicy(
            args.allowed_local_media_path, media_domains, engine.config.model.video_num_frames
        ),
        **args.tool_options,
        loras=loras,
        default_sampling=defaults,
        response_role=args.response_role,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        **fields,
    )


async def _serve(args: argparse.Namespace, config: EngineConfig, chat_template: str | None) -> int:
    from xlaserve.engine.async_llm import AsyncLLM

    served_model_names = args.served_model_name or [args.model or "smollm2"]
    loras = lora_registry(config, args.lora_modules, served_model_names)
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    for sig in (signal.SIGINT, signal.SIGTERM):  # a signal during start-up cancels it cleanly
        loop.add_signal_handler(sig, main_task.cancel)
    try:
        engine = AsyncLLM.from_config(  # spawns the engine core
            config,
            log_level=args.log_level,
            max_engine_restarts=args.max_engine_restarts,
            engine_restart_window=args.engine_restart_window,
        )
        # The front end's own imports (jax and transformers among them, ~1 s) overlap the core's load
        # and warm-up. Not in a thread: jax imported from two threads at once fails.
        import uvicorn

        from xlaserve.entrypoints.app import build_app
        from xlaserve.entrypoints.serving.guard import MAX_HEADER_BYTES
        from xlaserve.entrypoints.serving.http11 import JSONErrorH11Protocol
        from xlaserve.entrypoints.serving.state import CORS

        await engine.start()
    except asyncio.CancelledError:
        logger.info("interrupted during start-up")
        return 0
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    await check_started_engine(engine, loras, args.tool_options["reasoning_parser_cls"])
    # uvicorn handles the signals while it serves, then re-raises them: by then they must be harmless.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: None)

    state = request_state(
        args,
        engine,
        served_model_names,
        chat_template,
        loras,
        log_requests=not args.disable_log_requests,
        max_log_len=args.max_log_len,
        api_key=args.api_key,
        enable_admin_api=args.enable_admin_api,
        enable_profiler=engine.config.compilation.profiler_dir is not None,
        max_stored_responses=args.max_stored_responses,
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        enable_playground=not args.disable_playground,
        tool_servers=args.tool_servers,
        enable_docs=not args.disable_fastapi_docs,
        root_path=args.root_path,
        enable_force_include_usage=args.enable_force_include_usage,
        enable_request_id_headers=args.enable_request_id_headers,
        enable_server_load_tracking=args.enable_server_load_tracking,
        cors=None
        if not args.allowed_origins
        else CORS(args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials),
    )
    config = uvicorn.Config(
        build_app(state),
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_graceful_shutdown=args.shutdown_timeout + 2.0,  # a backstop: see _end_after_grace
        lifespan="off",
        http=JSONErrorH11Protocol,  # malformed HTTP answered in OpenAI's error JSON
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
    )
    server = uvicorn.Server(config)
    grpc_server = None
    if args.grpc_port is not None:
        from xlaserve.entrypoints.grpc.server import start_grpc_server

        try:
            grpc_server = await start_grpc_server(state, args.host, args.grpc_port)
        except OSError:
            await engine.shutdown()
            raise
    grace = asyncio.create_task(_end_after_grace(server, engine, args.shutdown_timeout))
    watchdog = asyncio.create_task(_exit_when_engine_fails(server, engine))
    stats = (
        None
        if args.disable_log_stats
        else asyncio.create_task(log_stats(engine.metrics, args.log_stats_interval))
    )
    try:
        await server.serve()
    finally:
        grace.cancel()
        watchdog.cancel()
        if stats is not None:
            stats.cancel()
        if grpc_server is not None:  # its streams end with the engine's requests (_end_after_grace)
            await grpc_server.stop(grace=1.0)
        logger.info("stopping the engine core")
        await engine.shutdown()
    if engine.failed.is_set():
        return 1
    return 0 if server.started or server.should_exit else 1
