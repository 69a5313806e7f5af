"""`xlaserve run-batch`: one run of the CLI (in process, its own engine) over a file of good and
hostile lines; every body must be the one the session's server sends for the same request."""

from __future__ import annotations

import json

import httpx
import pytest

from helpers.server_harness import MODEL_NAME, engine_flags
from xlaserve.engine.async_llm import AsyncLLM
from xlaserve.entrypoints.cli import main

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6}
COMPLETION = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 6, "logprobs": 1}
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
}
# Fields a server makes up per request.
PER_REQUEST = ("id", "created")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    folder = tmp_path_factory.mktemp("run-batch")
    with open(folder / "in.jsonl", "w") as f:
        for custom_id, line in LINES.items():
            f.write(
                line
                if isinstance(line, str)
                else json.dumps({"custom_id": custom_id, "method": "POST", **line})
            )
            f.write("\n\n")  # blank lines are skipped
    argv = [
        "run-batch",
        "-i",
        str(folder / "in.jsonl"),
        "-o",
        str(folder / "out.jsonl"),
        "--model",
        MODEL_NAME,
    ]
    at_shutdown = {}
    shutdown = AsyncLLM.shutdown

    async def record_then_shutdown(engine):
        metrics = engine.metrics
        at_shutdown.update(
            metrics.gauges, **metrics.counters, unfinished=engine.get_num_unfinished_requests()
        )
        await shutdown(engine)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(AsyncLLM, "shutdown", record_then_shutdown)
        assert main([*argv, *engine_flags(), "--disable-progress-bar"]) == 0
    # Only the good lines reached the engine; each finished, and none left KV blocks held (the gauges
    # the last step's output carried: the scheduler's stats did arrive).
    assert at_shutdown["request_success"] == 3 and at_shutdown["prefix_cache_queries"] > 0
    assert at_shutdown["unfinished"] == 0 and at_shutdown["num_requests_running"] == 0
    assert at_shutdown["kv_cache_usage_perc"] == 0
    with open(folder / "out.jsonl") as f:
        lines = [json.loads(line) for line in f]
    assert [line["custom_id"] for line in lines] == [None if k == "not-json" else k for k in LINES]
    return {custom_id: line for custom_id, line in zip(LINES, lines)}


def _split_logprobs(body: dict) -> tuple[dict, list]:
    """The body less its per-request ids, its logprob values and its cached-token count (what the
    engine's prefix cache held then: the session server has served other tests), and those values."""
    body = json.loads(json.dumps(body))
    (body.get("usage") or {}).pop("prompt_tokens_details", None)
    values = []
    for choice in body.get("choices", []):
        logprobs = choice.get("logprobs") or {}
        values += logprobs.pop("token_logprobs", [])
        values += [v for top in logprobs.pop("top_logprobs", []) for v in top.values()]
    return {k: v for k, v in body.items() if k not in PER_REQUEST}, values


@pytest.mark.parametrize("custom_id", ["chat", "completion", "chat-2", "neg-max-tokens", "hot"])
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
