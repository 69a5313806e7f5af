"""`xlaserve run-batch -i requests.jsonl -o results.jsonl`: a file in OpenAI's Batch API format, run
without a server (vLLM's `run-batch`).

Each line's body goes to the server's own app (app.build_app) in this process, as an ASGI call: no
socket, no uvicorn, but the same routes, validation and error handlers, so a line's response body is
the one `xlaserve serve` would send for that body. Lines run concurrently, so the engine batches them;
results are written in the input's order as they complete.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import uuid

from tqdm import tqdm

from xlaserve.entrypoints.api_server import (
    add_request_args,
    check_started_engine,
    default_sampling,
    load_chat_template,
    lora_registry,
)
from xlaserve.entrypoints.arg_utils import (
    add_tool_args,
    engine_config,
    parse_lora_modules,
    run_follower_if_needed,
    tool_options,
)

logger = logging.getLogger("xlaserve.entrypoints.run_batch")

# The routes a line may name: those of the server that answer a POST with one JSON body.
BATCH_URLS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/score",
    "/v1/rerank",
)
# Lines in flight at once, per engine sequence: enough to keep every step full, few enough to bound
# the memory a long file's pending lines hold.
_IN_FLIGHT_PER_SEQ = 2


def add_parser(sub, add_engine_args) -> None:
    p = sub.add_parser(
        "run-batch",
        help="run a JSONL file of OpenAI batch requests (chat, completions, embeddings, score, rerank) "
        "without a server; write one JSONL result a line, in order",
    )
    p.add_argument("-i", "--input-file", required=True, help="the requests: a local JSONL file")
    p.add_argument("-o", "--output-file", required=True, help="where to write the results (JSONL)")
    add_engine_args(p)
    g = p.add_argument_group("serving")
    add_request_args(g)
    g.add_argument("--disable-progress-bar", action="store_true", help="no progress bar on stderr")
    add_tool_args(p)
    p.set_defaults(func=cmd_run_batch)


def cmd_run_batch(args: argparse.Namespace) -> int:
    if run_follower_if_needed(args):  # node_rank > 0 of a multi-host engine: only steps
        return 0
    for flag, path in (("--input-file", args.input_file), ("--output-file", args.output_file)):
        if path.startswith(("http://", "https://")):
            raise ValueError(f"{flag}: {path!r} is a URL; run-batch reads and writes local files only")
    if not os.path.isfile(args.input_file):
        raise ValueError(f"--input-file: {args.input_file!r} is not a file")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.output_file))):
        raise ValueError(f"--output-file: the folder of {args.output_file!r} does not exist")
    config = engine_config(args)
    args.lora_modules = parse_lora_modules(args.lora_modules)
    if args.lora_modules and not config.lora.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    chat_template = load_chat_template(args.chat_template)
    args.tool_options = tool_options(args)
    with open(args.input_file, encoding="utf-8", errors="surrogateescape") as f:
        num_lines = sum(1 for line in f if line.strip())  # the progress bar's total
    return asyncio.run(_run(args, config, chat_template, num_lines))


async def _run(args: argparse.Namespace, config, chat_template: str | None, num_lines: int) -> int:
    # Here, not at the top: `xlaserve --help` and the other commands start without jax or fastapi.
    from xlaserve.engine.async_llm import AsyncLLM
    from xlaserve.engine.media import MediaPolicy
    from xlaserve.entrypoints.app import build_app
    from xlaserve.entrypoints.serving.state import ServerState

    served_model_names = args.served_model_name or [args.model or "smollm2"]
    loras = lora_registry(config, args.lora_modules, served_model_names)
    engine = AsyncLLM.from_config(config, log_level=args.log_level)
    await engine.start()
    await check_started_engine(engine, loras, args.tool_options["reasoning_parser_cls"])
    try:
        state = ServerState(
            engine=engine,
            served_model_names=served_model_names,
            chat_template=chat_template,
            trust_request_chat_template=args.trust_request_chat_template,
            log_requests=False,
            enable_playground=False,
            media_policy=MediaPolicy(
                args.allowed_local_media_path,
                tuple(d.lower() for d in args.allowed_media_domains),
                engine.config.model.video_num_frames,
            ),
            **args.tool_options,
            loras=loras,
            default_sampling=default_sampling(config),
        )
        max_in_flight = _IN_FLIGHT_PER_SEQ * engine.config.scheduler.max_num_seqs
        counts = await run_file(
            build_app(state),
            args.input_file,
            args.output_file,
            max_in_flight,
            num_lines,
            not args.disable_progress_bar,
        )
    finally:
        await engine.shutdown()
    logger.info("run-batch: %d lines, %d answered 200, %d with an error", sum(counts), *counts)
    return 0


async def run_file(
    app, input_file: str, output_file: str, max_in_flight: int, num_lines: int, progress: bool = True
) -> tuple[int, int]:
    """Run every non-blank line of `input_file` through `app`, at most `max_in_flight` at once, and
    write the results to `output_file` in the input's order; returns (lines answered 200, the others)."""
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
        open(input_file, encoding="utf-8", errors="surrogateescape") as inp,
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
