"""`xlaserve serve`'s flags and their checks before anything starts (TLS files, tool servers, the chat
template), and the request-shaping flags `run-batch` shares with it (`add_request_args`); the server's
start and run are api_server.py's."""

from __future__ import annotations

import argparse
import json
import os
import ssl

from xlaserve.config import CONTENT_FORMATS
from xlaserve.entrypoints.arg_utils import add_tool_args


def add_serve_args(p) -> None:
    """The `serve` command's own flags (the engine's are arg_utils')."""
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
    log_requests = g.add_mutually_exclusive_group()
    log_requests.add_argument("--disable-log-requests", action="store_true", help="do not log each request")
    log_requests.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log each request (the default here; vLLM's default is off)",
    )
    g.add_argument(
        "--max-log-len",
        type=_non_negative_int("--max-log-len"),
        default=None,
        metavar="N",
        help="request log lines also show the prompt's first N characters and token ids (default: no "
        "prompt in the log; vLLM's default shows it whole)",
    )
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


def _non_negative_int(flag: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = -1
        if value < 0:
            raise argparse.ArgumentTypeError(f"{flag} takes an integer >= 0, got {text!r}")
        return value

    return parse


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
        choices=CONTENT_FORMATS,
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
        help="usage.prompt_tokens_details: cached_tokens (the prompt tokens found in the prefix cache) and "
        "created_cache_tokens (those it added)",
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
