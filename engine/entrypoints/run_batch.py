"""`xlaserve run-batch -i requests.jsonl -o results.jsonl`: a file in OpenAI's Batch API format, run
without a server (vLLM's `run-batch`). Either may be an http(s) URL: the input is fetched (GET) before
the engine starts, so a bad URL costs no start; the results are staged in a file and uploaded (PUT, as
to a presigned object-store URL) once every line is done.

Each line's body goes to the server's own app (app.build_app) in this process, as an ASGI call: no
socket, no uvicorn, but the same routes, validation and error handlers, so a line's response body is
the one `xlaserve serve` would send for that body. Lines run concurrently, so the engine batches them;
results are written in the input's order as they complete.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import logging
import os
import tempfile
import uuid

from tqdm import tqdm

from xlaserve.entrypoints.api_server import check_started_engine, lora_registry, request_state
from xlaserve.entrypoints.arg_utils import (
    add_tool_args,
    engine_config,
    parse_lora_modules,
    run_follower_if_needed,
    tool_options,
)
from xlaserve.entrypoints.serve_args import add_request_args, load_chat_template

logger = logging.getLogger("xlaserve.entrypoints.run_batch")

# The routes a line may name: those of the server that answer a POST with one JSON body.
BATCH_URLS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/embeddings",
    "/v1/score",
    "/v1/rerank",
)
# Lines in flight at once, per engine sequence: enough to keep every step full, few enough to bound
# the memory a long file's pending lines hold.
_IN_FLIGHT_PER_SEQ = 2
# The GET of an input URL and the PUT of the results: seconds to connect, and to wait on each read or
# write (not the whole transfer: a large file takes longer).
_CONNECT_TIMEOUT_S = 30.0
_IO_TIMEOUT_S = 300.0


def add_parser(sub, add_engine_args) -> None:
    p = sub.add_parser(
        "run-batch",
        help="run a JSONL file of OpenAI batch requests (chat, completions, responses, embeddings, score, "
        "rerank) without a server; write one JSONL result a line, in order",
    )
    p.add_argument(
        "-i", "--input-file", required=True, help="the requests: a local JSONL file, or an http(s) URL to GET"
    )
    p.add_argument(
        "-o",
        "--output-file",
        required=True,
        help="where to write the results (JSONL): a local file, or an http(s) URL to PUT them to",
    )
    p.add_argument(
        "--output-tmp-dir",
        default=None,
        help="with an -o URL: the folder where the results are staged before the upload (default: the "
        "system's temporary folder); the staged file is removed once uploaded, kept if the upload fails",
    )
    add_engine_args(p)
    g = p.add_argument_group("serving")
    add_request_args(g)
    g.add_argument("--disable-progress-bar", action="store_true", help="no progress bar on stderr")
    g = p.add_argument_group("metrics")
    g.add_argument(
        "--enable-metrics",
        action="store_true",
        help="serve the engine's Prometheus metrics (the server's /metrics) while the batch runs",
    )
    g.add_argument(
        "--url",
        default="127.0.0.1",
        help="with --enable-metrics: the address to serve them on (0.0.0.0: every interface; as "
        "`serve --host`, this host only unless asked)",
    )
    g.add_argument("--port", type=int, default=8000, help="with --enable-metrics: the port to serve them on")
    add_tool_args(p)
    p.set_defaults(func=cmd_run_batch)


def cmd_run_batch(args: argparse.Namespace) -> int:
    if run_follower_if_needed(args):  # node_rank > 0 of a multi-host engine: only steps
        return 0
    is_upload = _is_url(args.output_file)
    if not is_upload and not os.path.isdir(os.path.dirname(os.path.abspath(args.output_file))):
        raise ValueError(f"--output-file: the folder of {args.output_file!r} does not exist")
    if args.output_tmp_dir is not None and not os.path.isdir(args.output_tmp_dir):
        raise ValueError(f"--output-tmp-dir: {args.output_tmp_dir!r} is not a folder")
    if args.enable_metrics and not 0 <= args.port <= 65535:
        raise ValueError(f"--port: {args.port} is not a port (0 to 65535)")
    config = engine_config(args)
    args.lora_modules = parse_lora_modules(args.lora_modules)
    if args.lora_modules and not config.lora.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    chat_template = load_chat_template(args.chat_template)
    args.tool_options = tool_options(args)
    with read_input(args.input_file) as inp:
        num_lines = sum(1 for line in inp if line.strip())  # the progress bar's total
        inp.seek(0)
        if not is_upload:
            return asyncio.run(_run(args, config, chat_template, inp, args.output_file, num_lines))
        fd, staged = tempfile.mkstemp(prefix="run-batch-", suffix=".jsonl", dir=args.output_tmp_dir)
        os.close(fd)
        try:
            asyncio.run(_run(args, config, chat_template, inp, staged, num_lines))
        except BaseException:
            os.remove(staged)  # a run that did not finish has no results to upload
            raise
    upload(staged, args.output_file)
    return 0


def _is_url(path: str) -> bool:
    return path.startswith(("http://", "https://"))


def _shown(url: str) -> str:
    """The URL for a message, less its query: a presigned URL's signature is a credential."""
    return url.split("?", 1)[0] + ("?..." if "?" in url else "")


def _http_timeout():
    import httpx  # here: the CLI starts without it

    return httpx.Timeout(_IO_TIMEOUT_S, connect=_CONNECT_TIMEOUT_S)


def read_input(path: str) -> io.TextIOBase:
    """The requests as a text stream: a local file, or the body of an http(s) URL (held in memory)."""
    if not _is_url(path):
        if not os.path.isfile(path):
            raise ValueError(f"--input-file: {path!r} is not a file")
        return open(path, encoding="utf-8", errors="surrogateescape")
    import httpx

    try:
        reply = httpx.get(path, follow_redirects=True, timeout=_http_timeout())
    except httpx.HTTPError as e:
        raise ValueError(f"--input-file: GET {_shown(path)} failed: {e}") from None
    if not reply.is_success:
        raise ValueError(
            f"--input-file: GET {_shown(path)} answered {reply.status_code} {reply.reason_phrase}"
        )
    return io.TextIOWrapper(io.BytesIO(reply.content), encoding="utf-8", errors="surrogateescape")


def upload(staged: str, url: str) -> None:
    """PUT the results file `staged` to `url` (its length in Content-Length, as a presigned object-store
    URL requires), then remove it; kept, and named in the error, when the upload fails."""
    import httpx

    try:
        with open(staged, "rb") as f:
            reply = httpx.put(url, content=f, timeout=_http_timeout())
        problem = None if reply.is_success else f"answered {reply.status_code} {reply.reason_phrase}"
    except httpx.HTTPError as e:
        problem = f"failed: {e}"
    if problem is not None:
        raise ValueError(f"--output-file: PUT {_shown(url)} {problem}; the results are kept in {staged}")
    os.remove(staged)
    logger.info("run-batch: results uploaded to %s", _shown(url))


async def _run(
    args: argparse.Namespace, config, chat_template: str | None, inp, output_file: str, num_lines: int
) -> int:
    # Here, not at the top: `xlaserve --help` and the other commands start without jax or fastapi.
    from prometheus_client import CollectorRegistry, start_http_server

    metrics_server = None
    if args.enable_metrics:  # bound before the engine starts: a port in use fails fast
        registry = CollectorRegistry(auto_describe=False)
        try:
            metrics_server, _ = start_http_server(args.port, args.url, registry)
        except OSError as e:
            raise ValueError(f"--url/--port: cannot serve metrics on {args.url}:{args.port}: {e}") from None
    try:
        from xlaserve.engine.async_llm import AsyncLLM
        from xlaserve.entrypoints.app import build_app
        from xlaserve.entrypoints.serving.metrics import EngineCollector

        served_model_names = args.served_model_name or [args.model or "smollm2"]
        loras = lora_registry(config, args.lora_modules, served_model_names)
        engine = AsyncLLM.from_config(config, log_level=args.log_level)
        if metrics_server is not None:
            registry.register(EngineCollector(engine, served_model_names[0]))
            logger.info("run-batch: metrics on http://%s:%d/metrics", args.url, args.port)
        await engine.start()
        await check_started_engine(engine, loras, args.tool_options["reasoning_parser_cls"])
        try:
            state = request_state(
                args,
                engine,
                served_model_names,
                chat_template,
                loras,
                log_requests=False,
                enable_playground=False,
            )
            max_in_flight = _IN_FLIGHT_PER_SEQ * engine.config.scheduler.max_num_seqs
            counts = await run_file(
                build_app(state), inp, output_file, max_in_flight, num_lines, not args.disable_progress_bar
            )
        finally:
            await engine.shutdown()
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()
    logger.info("run-batch: %d lines, %d answered 200, %d with an error", sum(counts), *counts)
    return 0


async def run_file(
    app, inp, output_file: str, max_in_flight: int, num_lines: int, progress: bool = True
) -> tuple[int, int]:
    """Run every non-blank line of the text stream `inp` through `app`, at most `max_in_flight` at once,
    and write the results to `output_file` in the input's order; returns (lines answered 200, the
    others)."""
    done: dict[int, dict] = {}
    next_to_write = 0
    counts = [0, 0]
    slots = asyncio.Semaphore(max_in_flight)
    bar = tqdm(total=num_lines, unit="req", desc="run-batch", disable=not progress)

    async def run(index: int, line: str) -> None:
        nonlocal next_to_write
        try:
            result = await run_line(app, line)
        finally:
            slots.release()
        counts[0 if result["response"]["status_code"] == 200 else 1] += 1
        bar.update()
        done[index] = result
        while next_to_write in done:  # a line is written once every line before it is
            out.write(json.dumps(done.pop(next_to_write), ensure_ascii=False) + "\n")
            next_to_write += 1

    tasks = set()
    with (
        # A custom_id holding a lone surrogate is written as its JSON escape.
        open(output_file, "w", encoding="utf-8", errors="backslashreplace") as out,
        bar,
    ):
        index = 0
        for line in inp:
            if not line.strip():
                continue
            await slots.acquire()
            task = asyncio.create_task(run(index, line))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            index += 1
        await asyncio.gather(*tasks)
    return counts[0], counts[1]


async def run_line(app, line: str) -> dict:
    """One line of the file, as the line of results it gets."""
    try:
        request = json.loads(line)
    except json.JSONDecodeError as e:
        return _result(None, _error(f"the line is not valid JSON: {e.msg}", None, "invalid_json"))
    except (RecursionError, ValueError) as e:  # the only other ValueError: an integer of > 4300 digits
        reason = (
            "arrays or objects nested too deeply" if isinstance(e, RecursionError) else "a number too long"
        )
        return _result(None, _error(f"the line is not valid JSON: {reason}", None, "invalid_json"))
    if not isinstance(request, dict):
        return _result(None, _error("the line must be a JSON object", None, "invalid_line"))
    custom_id = request.get("custom_id")
    custom_id = custom_id if isinstance(custom_id, str) else None
    problem = _check_line(request)
    if problem is not None:
        return _result(custom_id, problem)
    status, body = await post(app, request["url"], json.dumps(request["body"]).encode())
    return _result(custom_id, (status, body))


def _check_line(request: dict) -> tuple[int, dict] | None:
    """The batch line's own fields (the body is the server's to check), as OpenAI's Batch API
    validates them; None when they are fine."""
    for field in ("custom_id", "method", "url", "body"):
        if field not in request:
            return _error(f"'{field}' is a required property", field, "missing_field")
    if not isinstance(request["custom_id"], str):
        return _error("'custom_id' must be a string", "custom_id", "invalid_type")
    if request["method"] != "POST":
        return _error(f"'method' must be 'POST', got {request['method']!r:.40}", "method", "invalid_value")
    if request["url"] not in BATCH_URLS:
        return _error(
            f"'url' must be one of {', '.join(BATCH_URLS)}; got {request['url']!r:.100}",
            "url",
            "invalid_value",
        )
    if not isinstance(request["body"], dict):
        return _error("'body' must be a JSON object", "body", "invalid_type")
    if request["body"].get("stream") is True:  # any other value is the server's to refuse
        return _error(
            "'stream' is not supported in a batch file: each line gets its whole response",
            "stream",
            "unsupported_value",
        )
    if request["body"].get("encoding_format") == "bytes":  # the pooling routes' binary body
        return _error(
            "'encoding_format' 'bytes' is not supported in a batch file: a line of results holds JSON "
            "(send 'base64')",
            "encoding_format",
            "unsupported_value",
        )
    if request["url"] == "/v1/responses" and request["body"].get("background") is True:
        return _error(
            "'background' is not supported in a batch file: the run ends with its last line's response, "
            "so a response left running would be lost",
            "background",
            "unsupported_value",
        )
    return None


def _error(message: str, param: str | None, code: str) -> tuple[int, dict]:
    """A 400 with the body the server's error handlers write (serving/errors.py)."""
    # Here, not at the top: the CLI imports this module, and must start without fastapi.
    from xlaserve.entrypoints.serving.errors import bad_request

    return 400, bad_request(message, param, code).to_response().model_dump()


def _result(custom_id: str | None, response: tuple[int, dict]) -> dict:
    """A line of results: OpenAI's Batch output, where a failed request's status and error body are
    in `response` (and, as vLLM writes them, the error in `error` too)."""
    status, body = response
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": body.get("id") or _request_id(), "body": body},
        "error": body.get("error") if status != 200 else None,
    }


def _request_id() -> str:
    return f"batch-{uuid.uuid4().hex}"


async def post(app, path: str, body: bytes) -> tuple[int, dict]:
    """POST `body` (JSON) to `path` of the ASGI `app`, in process: (status code, the response's JSON)."""
    is_sent = False
    never = asyncio.Event()  # the client never disconnects: it waits for its whole response
    status = 500
    chunks: list[bytes] = []

    async def receive() -> dict:
        nonlocal is_sent
        if not is_sent:
            is_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": None,
        "server": None,
    }
    await app(scope, receive, send)
    return status, json.loads(b"".join(chunks))
