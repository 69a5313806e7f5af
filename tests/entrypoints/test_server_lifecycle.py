"""The server's own process life: a full queue, a dead engine core restarted in place, a clean exit
on SIGTERM while it restarts, and a non-zero exit when the core keeps dying.

These run on servers of their own (the session's stays healthy); every server of a session shares
the compilation cache, so each start, and each restart of a core, is warm. `fragile_server` has a
queue bound of zero (at most max_num_seqs requests are accepted at once) and a restart budget
large enough for its tests; `crash_loop_server` keeps the default budget.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.server_harness import MODEL_NAME, ServerProcess, pid_alive
from helpers.smollm2 import ENGINE_ARGS
from xlaserve.engine.supervisor import CoreDeaths, RestartPolicy

DEADLINE_S = 30  # liveness bound when waiting for the server to react, not a timing assertion
RESTART_DEADLINE_S = 240  # a warm restart takes 10-30 s on 2 cores that other work shares


@pytest.fixture(scope="module")
def fragile_server(tmp_path_factory, server_cache_dir):
    proc = ServerProcess(
        str(tmp_path_factory.mktemp("fragile-server")),
        server_cache_dir,
        extra_args=[
            "--max-num-queued-reqs",
            "0",
            "--shutdown-timeout",
            "2",
            # three deaths in this module, however slow the machine: none may end the server
            "--max-engine-restarts",
            "3",
            "--engine-restart-window",
            "3600",
        ],
    )
    proc.wait_ready()
    yield proc
    proc.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def crash_loop_server(tmp_path_factory, server_cache_dir):
    proc = ServerProcess(str(tmp_path_factory.mktemp("crash-loop-server")), server_cache_dir)
    proc.wait_ready()
    yield proc
    proc.stop(signal.SIGKILL)


def _completion(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"model": MODEL_NAME, **body}, timeout=60)


def _metric(server, name: str) -> float:
    """One sample of /metrics, by its name without the prefix (labels: only model_name)."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "xlaserve:" + name:
                assert sample.labels == {"model_name": MODEL_NAME}
                return sample.value
    raise AssertionError(f"no xlaserve:{name} in /metrics:\n{text}")


def _wait_for_health(server, status: int, deadline_s: float) -> float:
    """Poll /health until it answers `status`; the seconds that took."""
    start = time.monotonic()
    while (code := httpx.get(server.url + "/health", timeout=10).status_code) != status:
        assert server.proc.poll() is None, f"the server exited:\n{server.log_tail()}"
        assert time.monotonic() - start < deadline_s, f"/health still {code}:\n{server.log_tail()}"
        time.sleep(0.1)
    return time.monotonic() - start


def _new_core_pid(server, old_pid: int) -> int:
    """The pid of the core that replaces `old_pid`, as soon as it is spawned (before it is ready)."""
    deadline = time.monotonic() + DEADLINE_S
    while (pid := server.core_pid()) in (None, old_pid):
        assert server.proc.poll() is None, f"the server exited:\n{server.log_tail()}"
        assert time.monotonic() < deadline, "no new engine core was started"
        time.sleep(0.05)
    return pid


def _kill_and_wait_for_restart(server, core_pid: int) -> tuple[int, float]:
    """SIGKILL the core; check the server is unavailable meanwhile -> (new core pid, restart seconds)."""
    killed_at = time.monotonic()
    os.kill(core_pid, signal.SIGKILL)
    _wait_for_health(server, 503, DEADLINE_S)
    response = _completion(server, prompt="hello", max_tokens=2)
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "engine_dead" and "restart" in error["message"]
    # a dead engine's gauges are not reported as live
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert _metric(server, gauge) == 0, gauge
    _wait_for_health(server, 200, RESTART_DEADLINE_S)
    new_pid = server.core_pid()
    assert new_pid not in (None, core_pid) and not pid_alive(core_pid)
    return new_pid, time.monotonic() - killed_at


def _events(lines) -> list:
    """The JSON payloads of server-sent events, "[DONE]" kept as is."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_restart_policy():
    deaths = CoreDeaths(RestartPolicy(max_restarts=2, window_s=60.0))
    for t in (0.0, 30.0):
        assert deaths.record(t)
        deaths.mark_ready()
    assert not deaths.record(59.0)  # the third death within 60 s
    spread = CoreDeaths(RestartPolicy(max_restarts=2, window_s=60.0))
    for t in (0.0, 100.0, 200.0, 300.0):  # far apart, each core became ready: restarted forever
        assert spread.record(t)
        spread.mark_ready()
    slow_crash_loop = CoreDeaths(RestartPolicy(max_restarts=2, window_s=60.0))
    assert slow_crash_loop.record(0.0) and slow_crash_loop.record(100.0)  # never ready in between
    assert not slow_crash_loop.record(200.0)
    assert not CoreDeaths(RestartPolicy(max_restarts=0)).record(0.0)
    with pytest.raises(ValueError, match="max_engine_restarts"):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(ValueError, match="engine_restart_window"):
        RestartPolicy(window_s=0)


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
def test_core_death_restarts_the_core(fragile_server):
    server = fragile_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    core_pid = server.core_pid()
    assert core_pid is not None
    generated_before = _metric(server, "generation_tokens_total")
    body = {
        "model": MODEL_NAME,
        "prompt": "Once upon a time",
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", server.url + "/v1/completions", json=body) as stream,
    ):
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        killed_at = time.monotonic()
        os.kill(core_pid, signal.SIGKILL)
        events = _events([first, *lines])  # the stream ends by itself, with an error event
    assert time.monotonic() - killed_at < DEADLINE_S  # at once, not after the restart
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == "engine_dead"
    # the client learns what happened and what to do, not the core's pid or how it died: the log does
    assert str(core_pid) not in error["message"] and "SIGKILL" not in error["message"]
    assert f"pid {core_pid}) was killed by SIGKILL" in server.log_tail(10**7)

    _wait_for_health(server, 503, DEADLINE_S)
    response = _completion(server, prompt="hello", max_tokens=2)
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
    assert str(core_pid) not in response.text
    assert httpx.get(server.url + "/health").json()["error"]["code"] == "engine_dead"
    _wait_for_health(server, 200, RESTART_DEADLINE_S)
    restart_s = time.monotonic() - killed_at
    core_pid = server.core_pid()
    assert _metric(server, "engine_core_restarts_total") == 1
    assert _metric(server, "generation_tokens_total") > generated_before  # counters keep their totals
    completion = client.completions.create(
        model=MODEL_NAME, prompt="Hello", max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert completion.choices[0].text and completion.usage.completion_tokens == 4

    # killed again while idle: restarted again
    core_pid, second_restart_s = _kill_and_wait_for_restart(server, core_pid)
    assert _metric(server, "engine_core_restarts_total") == 2
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 4
    print(f"warm restarts (kill to /health 200): {restart_s:.1f}s, {second_restart_s:.1f}s")


@pytest.mark.slow
def test_sigterm_while_the_core_restarts(fragile_server):
    server = fragile_server
    core_pid = server.core_pid()
    os.kill(core_pid, signal.SIGKILL)
    _wait_for_health(server, 503, DEADLINE_S)
    new_pid = _new_core_pid(server, core_pid)  # starting, not ready yet
    code = server.stop(signal.SIGTERM)
    assert code == 0, server.log_tail()
    assert not pid_alive(core_pid) and not pid_alive(new_pid)


@pytest.mark.slow
def test_crash_loop_exits_nonzero(crash_loop_server):
    """The default budget: 2 restarts within 60 s. The third death, 2 cores dying in start-up, ends it."""
    server = crash_loop_server
    core_pid = server.core_pid()
    pids = [core_pid]
    os.kill(core_pid, signal.SIGKILL)
    for _ in range(2):
        core_pid = _new_core_pid(server, core_pid)
        pids.append(core_pid)
        os.kill(core_pid, signal.SIGKILL)
    try:
        code = server.proc.wait(DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server still runs after 3 deaths of its core:\n{server.log_tail()}")
    assert code == 1, server.log_tail()
    assert "giving up" in server.log_tail(10**7)
    assert not any(pid_alive(pid) for pid in pids)
