"""The server's own process life: a full queue, a dead engine core, and a clean exit on SIGTERM.

These run on a second server (the session's stays healthy), started with a queue bound of zero:
at most max_num_seqs requests are accepted at once.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from helpers.server_harness import MODEL_NAME, ServerProcess, pid_alive
from helpers.smollm2 import ENGINE_ARGS

DEADLINE_S = 30  # liveness bound when waiting for the server to react, not a timing assertion


@pytest.fixture(scope="module")
def fragile_server(tmp_path_factory, server_cache_dir):
    proc = ServerProcess(
        str(tmp_path_factory.mktemp("fragile-server")),
        server_cache_dir,
        extra_args=["--max-num-queued-reqs", "0", "--shutdown-timeout", "2"],
    )
    proc.wait_ready()
    yield proc
    proc.stop(signal.SIGKILL)


def _completion(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"model": MODEL_NAME, **body}, timeout=60)


def _events(lines) -> list:
    """The JSON payloads of server-sent events, "[DONE]" kept as is."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


@pytest.mark.slow
def test_full_queue_is_503(fragile_server):
    max_num_seqs = ENGINE_ARGS["max_num_seqs"]
    body = {
        "model": MODEL_NAME,
        "prompt": "Count:",
        "max_tokens": 200,
        "n": max_num_seqs,
        "stream": True,
        "ignore_eos": True,
    }
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", fragile_server.url + "/v1/completions", json=body) as stream,
    ):
        assert stream.status_code == 200
        lines = stream.iter_lines()  # kept: a dropped iterator closes the connection
        next(lines)  # its n sequences fill every slot
        response = _completion(fragile_server, prompt="one more", max_tokens=2)
        assert response.status_code == 503, fragile_server.log_tail()
        assert response.json()["error"]["code"] == "queue_full"
    # the stream's sequences were aborted when it closed: the server takes requests again
    deadline = time.monotonic() + DEADLINE_S
    while (response := _completion(fragile_server, prompt="one more", max_tokens=2)).status_code == 503:
        assert time.monotonic() < deadline, response.text
        time.sleep(0.2)
    assert response.status_code == 200


@pytest.mark.slow
def test_core_death_then_sigterm(fragile_server):
    server = fragile_server
    core_pid = server.core_pid()
    assert core_pid is not None
    body = {
        "model": MODEL_NAME,
        "prompt": "Once upon a time",
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", server.url + "/v1/completions", json=body) as stream,
    ):
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        os.kill(core_pid, signal.SIGKILL)
        events = _events([first, *lines])  # the stream ends by itself, with an error event
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    # The client learns that the engine is gone; how it died (and its pid) is for the log only.
    assert error["code"] == "engine_dead" and str(core_pid) not in error["message"]

    deadline = time.monotonic() + DEADLINE_S
    while (health := httpx.get(server.url + "/health")).status_code == 200:
        assert time.monotonic() < deadline, "/health still 200 after the core died"
        time.sleep(0.1)
    assert health.status_code == 503
    response = _completion(server, prompt="hello", max_tokens=2)
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
    response = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=60,
        json={"messages": [{"role": "user", "content": "hi"}], "stream": True},
    )
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "engine_dead"
    assert f"engine core process (pid {core_pid}) was killed by SIGKILL" in server.log_tail(2**20)

    code = server.stop(signal.SIGTERM)
    assert code == 0, server.log_tail()
    assert not pid_alive(core_pid)
