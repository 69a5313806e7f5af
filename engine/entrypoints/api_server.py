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
import json
import logging
import os
import signal
import ssl

from xlaserve.config import EngineConfig
from xlaserve.engine.media import MediaPolicy
from xlaserve.engine.stat_logger import log_stats, log_stats_interval
from xlaserve.entrypoints.arg_utils import (
    add_tool_args,
    auto_tool_choice,
    engine_config,
    parse_lora_modules,
    run_follower_if_needed,
    tool_options,
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
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--api-key",
        default=os.environ.get("XLASERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /tokenizer_info, /detokenize and "
        "the admin routes (also XLASERVE_API_KEY)",
    )
    g.add_argument(
        "--allowed-origins",
        type=_json_list("--allowed-origins"),
        default=[],
        help="web pages (origins) whose scripts may call this server, as JSON: '[\"https://ui.example\"]', "
        "'[\"*\"]' for any (vLLM's default; here none: any page a user opens could reach a local server)",
    )
    g.add_argument("--allowed-methods", type=_json_list("--allowed-methods"), default=["*"], help="(CORS)")
    g.add_argument("--allowed-headers", type=_json_list("--allowed-headers"), default=["*"], help="(CORS)")
    g.add_argument("--allow-credentials", action="store_true", help="(CORS: cookies and auth headers)")
    g.add_argument("--disable-fastapi-docs", action="store_true", help="no /docs, /redoc or /openapi.json")
    g.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no periodic log line of throughput, queues, KV cache and prefix cache use (every "
        "XLASERVE_LOG_STATS_INTERVAL seconds, default 10, while the engine works)",
    )
    g.add_argument(
        "--enable-admin-api",
        action="store_true",
        help="serve POST /update_weights_from_disk, /sleep, /wake_up, /reset_prefix_cache and GET "
        "/is_sleeping (needs --api-key)",
    )
    g.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="serve GET /tokenizer_info: the tokenizer's configuration and chat template (lm-eval's "
        "local-completions tokenizes through it; behind --api-key)",
    )
    add_request_args(g)
    g.add_argument(
        "--max-num-queued-reqs",
        type=int,
        default=None,
        help="accept at most max-num-seqs running plus this many waiting requests; then 503",
    )
    g.add_argument(
        "--max-engine-restarts",
        type=int,
        default=2,
        help="restart a dead engine core after at most this many deaths within --engine-restart-window "
        "(or in a row); one more and the server exits 1 (0: exit on the first death)",
    )
    g.add_argument(
        "--engine-restart-window",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="the window --max-engine-restarts counts deaths in",
    )
    g.add_argument(
        "--max-stored-responses",
        type=int,
        default=1000,
        metavar="N",
        help="keep at most N responses of /v1/responses in memory (store: true), least recently used "
        "dropped first; 0: store none",
    )
    g.add_argument(
        "--grpc-port",
        type=int,
        default=None,
        help="also serve gRPC (xlaserve.v1.Generation, health, reflection) on this port, same host and "
        "API key; needs the grpc extra",
    )
    g.add_argument(
        "--tool-server",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="an MCP server /v1/responses may call for `mcp` tools (repeatable, or comma-separated); a "
        "request's server_url elsewhere is a 400",
    )
    g.add_argument(
        "--disable-playground", action="store_true", help="do not serve the chat playground page at GET /"
    )
    g.add_argument("--disable-log-requests", action="store_true", help="do not log each request")
    g.add_argument(
        "--root-path",
        default=None,
        help="the path prefix a proxy serves this server under (FastAPI's root_path: the OpenAPI "
        "schema's server URL and the docs' schema link carry it)",
    )
    g.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="streamed completions end with a usage chunk even without stream_options.include_usage",
    )
    g.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="answer every request with an X-Request-Id header: the request's own, else a new one",
    )
    g.add_argument(
        "--enable-server-load-tracking",
        action="store_true",
        help="count the generation and pooling requests in flight, read at GET /load",
    )
    g.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM)")
    g.add_argument("--ssl-certfile", default=None, help="and this certificate chain (PEM)")
    g.add_argument(
        "--ssl-ca-certs", default=None, help="CA certificates clients' certificates are checked with"
    )
    g.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=int(ssl.CERT_NONE),
        choices=[int(ssl.CERT_NONE), int(ssl.CERT_OPTIONAL), int(ssl.CERT_REQUIRED)],
        help="client certificates: 0 not asked for, 1 checked when sent, 2 required (Python's ssl.CERT_*)",
    )
    add_tool_args(p)
    g.add_argument("--disable-uvicorn-access-log", action="store_true")
    g.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        help="seconds in-flight requests get to finish after SIGINT/SIGTERM",
    )
    p.set_defaults(func=cmd_serve)


def parse_tool_servers(values: list[str]) -> list[str]:
    """--tool-server values (each one or comma-separated HOST:PORT) as 'host:port' strings."""
    servers = []
    for value in values:
        for entry in filter(None, (part.strip() for part in value.split(","))):
            host, sep, port = entry.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"--tool-server: {entry!r} is not HOST:PORT")
            servers.append(f"{host.strip('[]')}:{int(port)}")
    return servers


def load_chat_template(value: str | None) -> str | None:
    """A template given inline, or the contents of the file it names."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{%" in value or "{{" in value:
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")


def check_ssl_args(args: argparse.Namespace) -> None:
    """The TLS files read and the context built as uvicorn will, before the engine starts: a missing,
    unreadable or malformed file fails the start naming its flag."""
    if args.ssl_keyfile is None and args.ssl_certfile is None:
        if args.ssl_ca_certs is not None:
            raise ValueError("--ssl-ca-certs needs --ssl-keyfile and --ssl-certfile (HTTPS)")
        return
    if args.ssl_certfile is None:
        raise ValueError("--ssl-keyfile needs --ssl-certfile")
    for flag in ("--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs"):
        path = getattr(args, flag[2:].replace("-", "_"))
        if path is None:
            continue
        try:
            with open(path, "rb") as f:
                f.read(1)
        except OSError as e:
            raise ValueError(f"{flag}: cannot read {path!r}: {e.strerror or e}") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
    except ssl.SSLError as e:
        flags = "--ssl-certfile" if args.ssl_keyfile is None else "--ssl-certfile and --ssl-keyfile"
        raise ValueError(f"{flags}: not a PEM certificate chain and its key: {e.reason or e}") from None
    if args.ssl_ca_certs is not None:
        try:
            context.load_verify_locations(args.ssl_ca_certs)
        except ssl.SSLError as e:
            raise ValueError(
                f"--ssl-ca-certs: {args.ssl_ca_certs!r} holds no PEM CA certificate: {e}"
            ) from None


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


def _json_list(flag: str):
    """vLLM's form of the CORS flags: a JSON list of strings."""

    def parse(text: str) -> list[str]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"{flag} takes a JSON list of strings, got {text!r}")
        return value

    return parse


def add_request_args(g) -> None:
    """The flags of how requests are read, which `serve` and `run-batch` share: the model's names, chat
    templates, where image and video URLs may point."""
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use in 'model'; the first is reported (default: MODEL or 'smollm2')",
    )
    g.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one")
    g.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a chat template sent in a request's `chat_template` (refused otherwise: a template "
        "is code the server runs, in Jinja's sandbox)",
    )
    g.add_argument(
        "--chat-template-content-format",
        choices=["auto", "string", "openai"],
        default="auto",
        help="how a message's content reaches the chat template: string (its text parts joined), openai "
        "(a list of parts, {'type': 'text', 'text': ...} and {'type': 'image'}); auto: openai for a "
        "template that loops over a message's content, else string",
    )
    g.add_argument(
        "--response-role",
        default="assistant",
        help="the role of chat completion messages when the request asks for a generation prompt",
    )
    g.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage.prompt_tokens_details.cached_tokens: the prompt tokens found in the prefix cache",
    )
    g.add_argument(
        "--allowed-local-media-path",
        default=None,
        help="image and video parts may name file:// URLs under this directory (default: none may)",
    )
    g.add_argument(
        "--allowed-media-domains",
        nargs="*",
        default=[],
        help="hosts whose http(s):// image and video URLs are downloaded (default: none; data: URLs "
        "always work)",
    )


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
