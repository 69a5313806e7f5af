"""`xlaserve run-batch`: one run of the CLI (in process, its own engine) over a file of good and
hostile lines, read from and written to URLs (a small HTTP server in a thread), its metrics served;
every body must be the one the session's server sends for the same request. Bad URLs and flags fail
before any engine starts."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import types

import httpx
import pytest

from helpers.server_harness import MODEL_NAME, engine_flags, metric, metrics
from helpers.smollm2 import ENGINE_ARGS
from xlaserve.engine.async_llm import AsyncLLM
from xlaserve.entrypoints import run_batch
from xlaserve.entrypoints.cli import main

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6}
COMPLETION = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 6, "logprobs": 1}
# store: false, so that the session server's small response store is left as its own tests expect.
RESPONSE = {"model": MODEL_NAME, "input": "Name a colour.", "max_output_tokens": 6, "store": False}
# custom_id -> the line (a dict is written as JSON, a str as it is), in the file's order; the good lines
# are greedy, around the hostile ones, so that order and batching both show.
LINES = {
    "chat": {"url": "/v1/chat/completions", "body": {**CHAT, "temperature": 0}},
    "not-json": '{"custom_id": "not-json", "method": "POST",',
    "no-url": {"body": CHAT},
    "bad-url": {"url": "/v1/models", "body": CHAT},
    "stream": {"url": "/v1/chat/completions", "body": {**CHAT, "stream": True}},
    "neg-max-tokens": {"url": "/v1/completions", "body": {**COMPLETION, "max_tokens": -1}},
    "hot": {"url": "/v1/chat/completions", "body": {**CHAT, "temperature": "hot"}},
    "completion": {"url": "/v1/completions", "body": {**COMPLETION, "temperature": 0}},
    "chat-2": {"url": "/v1/chat/completions", "body": {**CHAT, "max_tokens": 3, "temperature": 0}},
    "responses": {"url": "/v1/responses", "body": {**RESPONSE, "temperature": 0}},
    "responses-stream": {"url": "/v1/responses", "body": {**RESPONSE, "stream": True}},
    "responses-background": {"url": "/v1/responses", "body": {**RESPONSE, "background": True, "store": True}},
    "responses-bad": {"url": "/v1/responses", "body": {**RESPONSE, "max_output_tokens": -1}},
    "embed-bytes": {"url": "/v1/embeddings", "body": {"input": "Hi", "encoding_format": "bytes"}},
}
NUM_RUN = 4  # the lines that reach the engine
BATCH_ROLE = "narrator"  # the run's --response-role (the session server answers as the assistant)
# Fields a server makes up per request.
PER_REQUEST = ("id", "created", "created_at")


class _FileHandler(http.server.BaseHTTPRequestHandler):
    """An object store's presigned URLs, in small: GET a file, PUT one (its Content-Length required);
    a PUT under /fail/ is answered 500."""

    def do_GET(self):
        body = self.server.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_PUT(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path.startswith("/fail/"):
            self.send_error(500)
            return
        self.server.files[self.path] = body
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def file_server():
    """(its base URL, its files by path), on 127.0.0.1; /small.jsonl holds two lines."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FileHandler)
    server.files = {"/small.jsonl": b'{"custom_id": "a"}\n{"custom_id": "b"}\n'}
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)  # a quick shutdown
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", server.files
    server.shutdown()
    server.server_close()
    thread.join()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory, file_server) -> dict[str, dict]:
    url, files = file_server
    text = ""
    for custom_id, line in LINES.items():
        text += (
            line if isinstance(line, str) else json.dumps({"custom_id": custom_id, "method": "POST", **line})
        )
        text += "\n\n"  # blank lines are skipped
    files["/batch.jsonl"] = text.encode()
    staging = tmp_path_factory.mktemp("run-batch")
    metrics_url = f"http://127.0.0.1:{_free_port()}"
    argv = [
        "run-batch",
        "-i",
        url + "/batch.jsonl",
        "-o",
        url + "/results/out.jsonl",
        "--output-tmp-dir",
        str(staging),
        "--enable-metrics",
        "--url",
        "127.0.0.1",
        "--port",
        metrics_url.rsplit(":", 1)[1],
        "--model",
        MODEL_NAME,
        "--response-role",
        BATCH_ROLE,
        "--enable-prompt-tokens-details",
    ]
    at_shutdown = {}
    shutdown = AsyncLLM.shutdown

    async def record_then_shutdown(engine):
        metrics_ = engine.metrics
        at_shutdown.update(
            metrics_.gauges,
            **metrics_.counters,
            request_success=sum(metrics_.finish_reasons.values()),
            unfinished=engine.get_num_unfinished_requests(),
        )
        at_shutdown["scraped"] = metrics(types.SimpleNamespace(url=metrics_url))  # --enable-metrics'
        await shutdown(engine)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(AsyncLLM, "shutdown", record_then_shutdown)
        assert main([*argv, *engine_flags(), "--disable-progress-bar"]) == 0
    # Only the good lines reached the engine; each finished, and none left KV blocks held (the gauges
    # the last step's output carried: the scheduler's stats did arrive).
    assert at_shutdown["request_success"] == NUM_RUN and at_shutdown["prefix_cache_queries"] > 0
    assert at_shutdown["unfinished"] == 0 and at_shutdown["num_requests_running"] == 0
    assert at_shutdown["kv_cache_usage_perc"] == 0
    # The metrics served while the batch ran: vLLM's names, as the server's /metrics has them.
    scraped = at_shutdown["scraped"]
    finished = {
        reason: metric(scraped, "request_success_total", finished_reason=reason)
        for reason in ("stop", "length", "abort")
    }
    assert sum(finished.values()) == NUM_RUN and finished["abort"] == 0
    assert metric(scraped, "prompt_tokens_total") == at_shutdown["prompt_tokens"] > 0
    assert list(staging.iterdir()) == []  # the staged results, removed once uploaded
    lines = [json.loads(line) for line in files.pop("/results/out.jsonl").decode().splitlines()]
    assert [line["custom_id"] for line in lines] == [None if k == "not-json" else k for k in LINES]
    return {custom_id: line for custom_id, line in zip(LINES, lines)}


def _split_logprobs(body: dict) -> tuple[dict, list]:
    """The body less its per-request ids, its logprob values and its cached-token count (what the
    engine's prefix cache held then: the session server has served other tests), and those values."""
    body = json.loads(json.dumps(body))
    (body.get("usage") or {}).pop("prompt_tokens_details", None)
    (body.get("usage") or {}).pop("input_tokens_details", None)
    for choice in body.get("choices", []):  # the run's --response-role
        (choice.get("message") or {}).pop("role", None)
    for item in body.get("output", []):  # a response's output items
        item.pop("id", None)
    values = []
    for choice in body.get("choices", []):
        logprobs = choice.get("logprobs") or {}
        values += logprobs.pop("token_logprobs", [])
        values += [v for top in logprobs.pop("top_logprobs", []) for v in top.values()]
    return {k: v for k, v in body.items() if k not in PER_REQUEST}, values


@pytest.mark.parametrize(
    "custom_id", ["chat", "completion", "chat-2", "responses", "neg-max-tokens", "hot", "responses-bad"]
)
def test_bodies_are_the_servers(server, results, custom_id):
    """Answered or refused, a line's status and body are the server's for its body: the same tokens
    and text; logprobs within float32's batch-to-batch noise (the server ran the line alone)."""
    line = LINES[custom_id]
    reply = httpx.post(server.url + line["url"], json=line["body"], headers=server.headers, timeout=120)
    result = results[custom_id]
    assert result["response"]["status_code"] == reply.status_code
    body, logprobs = _split_logprobs(result["response"]["body"])
    expected, expected_logprobs = _split_logprobs(reply.json())
    assert body == expected
    assert logprobs == pytest.approx(expected_logprobs, abs=1e-4)
    if reply.status_code == 200:
        assert result["error"] is None
        assert result["response"]["request_id"] == result["response"]["body"]["id"]
    else:
        assert result["error"] == reply.json()["error"]


def test_generated_lines(results):
    chat, completion = results["chat"]["response"]["body"], results["completion"]["response"]["body"]
    assert chat["choices"][0]["message"]["role"] == BATCH_ROLE
    # --enable-prompt-tokens-details: each prompt's prefix-cache hit, whole blocks (the completion's
    # prompt is shorter than one).
    assert completion["usage"]["prompt_tokens_details"] == {"cached_tokens": 0, "created_cache_tokens": 0}
    assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] % ENGINE_ARGS.get("block_size", 16) == 0
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["content"]
    assert (
        completion["object"] == "text_completion" and len(completion["choices"][0]["logprobs"]["tokens"]) == 6
    )
    # The two chats share a prompt: greedy, the shorter reply is the longer one's start.
    short = results["chat-2"]["response"]["body"]["choices"][0]["message"]["content"]
    assert chat["choices"][0]["message"]["content"].startswith(short)


@pytest.mark.parametrize(
    ("custom_id", "param", "code"),
    [
        ("neg-max-tokens", "max_tokens", None),
        ("hot", "temperature", "invalid_type"),
        ("not-json", None, "invalid_json"),
        ("no-url", "url", "missing_field"),
        ("bad-url", "url", "invalid_value"),
        ("stream", "stream", "unsupported_value"),
        ("responses-stream", "stream", "unsupported_value"),
        ("responses-background", "background", "unsupported_value"),
        ("responses-bad", "max_output_tokens", None),
        ("embed-bytes", "encoding_format", "unsupported_value"),
    ],
)
def test_hostile_lines_get_their_own_errors(results, custom_id, param, code):
    result = results[custom_id]
    assert result["response"]["status_code"] == 400
    error = result["response"]["body"]["error"]
    assert result["error"] == error and error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert code is None or error["code"] == code
    if param is not None:
        assert param in error["message"]


@pytest.fixture
def no_engine(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(AsyncLLM, "from_config", refuse)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["-i", "{url}/missing.jsonl"], "--input-file: GET {url}/missing.jsonl answered 404 Not Found"),
        # A presigned URL's query (its signature) is left out of the message.
        (["-i", "{dead}/in.jsonl?X-Amz-Signature=secret"], "--input-file: GET {dead}/in.jsonl?... failed: "),
        (["--output-tmp-dir", "/no/such/folder"], "--output-tmp-dir: '/no/such/folder' is not a folder"),
        (["--enable-metrics", "--port", "65536"], "--port: 65536 is not a port (0 to 65535)"),
        (
            ["--enable-metrics", "--url", "127.0.0.1", "--port", "{busy}"],
            "--url/--port: cannot serve metrics",
        ),
    ],
    ids=["input-404", "input-unreachable", "output-tmp-dir", "port-range", "port-busy"],
)
def test_bad_urls_and_flags_fail_before_an_engine_starts(file_server, no_engine, capsys, flags, message):
    url = file_server[0]
    with socket.socket() as busy, socket.socket() as dead:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        dead.bind(("127.0.0.1", 0))  # bound, never listening: a connection is refused
        ports = {
            "url": url,
            "dead": f"http://127.0.0.1:{dead.getsockname()[1]}",
            "busy": busy.getsockname()[1],
        }
        flags = [flag.format(**ports) for flag in flags]
        argv = ["run-batch", "-i", url + "/small.jsonl", "-o", url + "/out.jsonl", "--model", MODEL_NAME]
        assert main([*argv, *flags]) == 2
    err = capsys.readouterr().err
    assert "error: " + message.format(**ports) in err
    assert "secret" not in err and "Traceback" not in err


def test_a_failed_upload_keeps_the_results(file_server, tmp_path, monkeypatch, capsys):
    """A PUT answered 500: the run exits 2 naming the URL, the status and the staged results, kept."""
    url, files = file_server

    async def echo(args, config, chat_template, inp, output_file, num_lines):  # the lines, as results
        with open(output_file, "w") as out:
            out.write(inp.read())
        return 0

    monkeypatch.setattr(run_batch, "_run", echo)
    argv = ["run-batch", "-i", url + "/small.jsonl", "-o", url + "/fail/out.jsonl", "--model", MODEL_NAME]
    assert main([*argv, "--output-tmp-dir", str(tmp_path)]) == 2
    (staged,) = tmp_path.iterdir()
    assert staged.read_bytes() == files["/small.jsonl"]
    err = capsys.readouterr().err
    assert (
        f"error: --output-file: PUT {url}/fail/out.jsonl answered 500 Internal Server Error; the results are "
        f"kept in {staged}\n"
    ) in err
