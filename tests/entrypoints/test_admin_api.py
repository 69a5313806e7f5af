"""The admin routes (serving/admin.py) on a real `xlaserve serve` of a tiny Llama: with
--enable-admin-api and the API key, the weights are swapped from disk (the outputs change, and come
back with the first checkpoint), the engine sleeps (requests get a 400 saying so) and wakes with the
same outputs, the prefix cache resets; a request running meanwhile goes by vLLM's semantics (a reset
of the running requests preempts it, a sleep aborts it, waits for it or keeps it) and streams what an
undisturbed run streams; a caller's error is a 400 naming it; without the key a 401, without the flag
no such route, and the flag without a key refuses to start."""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import time

import httpx
import pytest
from test_server_hostile import BAD_TEXT, WRONG_TYPES, body_with, check_error, check_still_serving, send

from helpers.server_harness import ServerProcess, metric, metrics, wait_for_metrics
from helpers.tiny_models import TINY_PROCESS_ENV
from xlaserve.entrypoints import cli

KEY = "sk-admin-test"
ORIGIN = "https://ui.example"  # the one web page this module's server lets call it (--allowed-origins)
PROMPT = [5, 17, 33, 4, 60, 8, 21, 90, 11, 3, 44, 70]


@pytest.fixture(scope="module")
def dirs(llama_checkpoints):
    """Checkpoints A (the engine starts on it) and B (the trainer's next weights): conftest.py."""
    return llama_checkpoints


@pytest.fixture(scope="module")
def profiles(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("profiles"))


@pytest.fixture(scope="module")
def admin_server(dirs, tmp_path_factory, server_cache_dir, profiles):
    flags = ["--enable-admin-api", "--enforce-eager", "--max-model-len", "128", "--served-model-name", "tiny",
             "--profiler-dir", profiles, "--allowed-origins", json.dumps([ORIGIN])]  # fmt: skip
    proc = ServerProcess(
        str(tmp_path_factory.mktemp("logs")),
        server_cache_dir,
        flags,
        api_key=KEY,
        model=dirs[0],
        env={**TINY_PROCESS_ENV, "XLASERVE_LOG_STATS_INTERVAL": "0.5"},  # the stats line, soon
    )
    proc.wait_ready()
    yield proc
    proc.stop()


def complete(server, expect: int = 200):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "logprobs": 1}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=120)
    assert r.status_code == expect, r.text
    return r.json()["choices"][0]["logprobs"]["token_logprobs"] if expect == 200 else r.json()


def admin(server, method: str, path: str, expect: int = 200, **kw):
    r = httpx.request(method, server.url + path, headers=server.headers, timeout=120, **kw)
    assert r.status_code == expect, r.text
    return r.json()


def test_a_profile_records_the_engines_programs(admin_server, profiles):
    """vLLM's /start_profile and /stop_profile (with --profiler-dir): a jax.profiler trace of the engine
    core's process around a request, its Perfetto file holding the engine's forward program; a second
    start, or a stop with none running, is a 400."""
    assert admin(admin_server, "POST", "/start_profile") == {"profiling": True}
    assert "already running" in admin(admin_server, "POST", "/start_profile", expect=400)["error"]["message"]
    complete(admin_server)
    assert admin(admin_server, "POST", "/stop_profile") == {"profiling": False, "profiler_dir": profiles}
    assert (
        "no profile is running"
        in admin(admin_server, "POST", "/stop_profile", expect=400)["error"]["message"]
    )
    (trace,) = glob.glob(os.path.join(profiles, "plugins", "profile", "*", "perfetto_trace.json.gz"))
    with gzip.open(trace) as f:
        events = json.load(f)
    names = {e.get("name") or "" for e in (events["traceEvents"] if isinstance(events, dict) else events)}
    assert any("forward" in name for name in names), sorted(names)[:50]


def test_weights_swap_from_disk_and_back(admin_server, dirs):
    on_a = complete(admin_server)
    out = admin(admin_server, "POST", "/update_weights_from_disk", json={"model_path": dirs[1]})
    assert out["success"] and out["num_weights"] > 0
    on_b = complete(admin_server)
    assert on_b != on_a
    admin(admin_server, "POST", "/update_weights_from_disk", json={"model_path": dirs[0]})
    assert complete(admin_server) == on_a  # bit for bit: the prefix cache held nothing of B's
    assert admin(admin_server, "POST", "/reset_prefix_cache") == {"success": True}


def test_sleep_refuses_requests_and_wake_up_restores_the_outputs(admin_server):
    before = complete(admin_server)
    assert admin(admin_server, "GET", "/is_sleeping") == {"is_sleeping": False}
    asleep = admin(admin_server, "POST", "/sleep", params={"level": 2})
    assert asleep["level"] == 2 and asleep["freed_bytes"] > 0
    assert admin(admin_server, "GET", "/is_sleeping") == {"is_sleeping": True}
    assert "asleep" in complete(admin_server, expect=400)["error"]["message"]
    assert "already asleep" in admin(admin_server, "POST", "/sleep", expect=400)["error"]["message"]
    assert sleep_states(admin_server) == {"awake": 0, "weights_offloaded": 0, "discard_all": 1}
    awake = admin(admin_server, "POST", "/wake_up")
    assert awake["placed_bytes"] == asleep["freed_bytes"]
    assert sleep_states(admin_server) == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}
    assert complete(admin_server) == before


# Tokens (as many as max_model_len allows): the request still runs when an admin call made on an open
# connection after its first token arrives.
LONG = 128 - len(PROMPT)


def streamed(server, *calls) -> tuple[tuple[list[int], str], list[dict]]:
    """A greedy LONG request streamed, the admin `calls` (method, path, params) made on an open connection
    once its first token is back -> (its token ids, its finish reason), the calls' answers. With no
    calls, the undisturbed run (the first stream of a process also warms what would delay a later
    one's first token)."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": LONG, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}  # fmt: skip
    chunks, answers = [], []
    with (
        httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as client,
        httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as admin_client,
    ):
        assert admin_client.get("/is_sleeping").status_code == 200  # connected before the request starts
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = (line for line in response.iter_lines() if line.startswith("data: {"))
            chunks.append(json.loads(next(lines)[6:])["choices"][0])
            for method, path, params in calls:
                r = admin_client.request(method, path, params=params)
                assert r.status_code == 200, r.text
                answers.append(r.json())
            chunks += [json.loads(line[6:])["choices"][0] for line in lines]
    ids = [i for c in chunks for i in c.get("token_ids") or []]
    return (ids, chunks[-1]["finish_reason"]), answers


def test_reset_running_requests_preempts_and_the_stream_goes_on_unchanged(admin_server):
    """vLLM's reset_running_requests (RL clients send it after a weight update): the running request is
    preempted (one preemption), recomputes its K/V and streams the undisturbed run's ids."""
    expected, _ = streamed(admin_server)
    before = metric(metrics(admin_server), "num_preemptions_total")
    reset = ("POST", "/reset_prefix_cache", {"reset_running_requests": "true"})
    assert streamed(admin_server, reset) == (expected, [{"success": True}])
    assert metric(metrics(admin_server), "num_preemptions_total") - before == 1


def test_sleep_aborts_waits_for_or_keeps_a_running_request(admin_server):
    """vLLM's sleep modes: abort (the default) ends the request at once with finish_reason abort; wait
    sleeps once it finished; keep holds it, and after wake_up it streams on as undisturbed."""
    expected, _ = streamed(admin_server)
    wake_up, asleep = ("POST", "/wake_up", None), ("GET", "/is_sleeping", None)
    (ids, reason), _ = streamed(admin_server, ("POST", "/sleep", None), wake_up)
    assert reason == "abort" and ids == expected[0][: len(ids)] and len(ids) < LONG
    # wait: the request finished before the sleep answered.
    got, (_, is_sleeping, _) = streamed(admin_server, ("POST", "/sleep", {"mode": "wait"}), asleep, wake_up)
    assert got == expected and is_sleeping == {"is_sleeping": True}
    # keep (at level 2, the weights off the device too): the request waits while the engine sleeps.
    keep = ("POST", "/sleep", {"mode": "keep", "level": 2})
    got, (_, is_sleeping, _) = streamed(admin_server, keep, asleep, wake_up)
    assert got == expected and is_sleeping == {"is_sleeping": True}
    assert admin(admin_server, "GET", "/is_sleeping") == {"is_sleeping": False}


def sleep_states(server) -> dict[str, float]:
    """vLLM's engine_sleep_state, by its sleep_state label."""
    samples = metrics(server)
    return {
        s: metric(samples, "engine_sleep_state", sleep_state=s)
        for s in ("awake", "weights_offloaded", "discard_all")
    }


def test_metrics_after_a_known_workload(admin_server):
    """Three greedy requests of 5 tokens each move vLLM's counters and histograms by exactly that much:
    3 successes (length), 15 generated tokens, 3 TTFTs and e2e latencies, 4 inter-token gaps each; the
    token histograms' buckets end at max_model_len (128: the last bound 100), as vLLM's."""
    before = metrics(admin_server)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    for _ in range(3):
        r = httpx.post(
            admin_server.url + "/v1/completions", json=body, headers=admin_server.headers, timeout=120
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text

    def delta(samples, name: str, **labels) -> float:
        return metric(samples, name, **labels) - metric(before, name, **labels)

    after = wait_for_metrics(
        admin_server,
        lambda m: delta(m, "request_success_total", finished_reason="length") == 3,
        "the three requests counted",
    )
    assert delta(after, "generation_tokens_total") == 15
    assert delta(after, "prompt_tokens_total") == 3 * len(PROMPT)
    assert delta(after, "time_to_first_token_seconds_count") == 3
    assert delta(after, "e2e_request_latency_seconds_count") == 3
    assert delta(after, "inter_token_latency_seconds_count") == 3 * 4
    assert delta(after, "request_time_per_output_token_seconds_count") == 3
    assert delta(after, "request_generation_tokens_sum") == 15
    assert delta(after, "request_generation_tokens_bucket", le="5") == 3
    assert delta(after, "request_generation_tokens_bucket", le="2") == 0
    assert delta(after, "iteration_tokens_total_sum") == 3 * (len(PROMPT) + 5)
    # The prompt (12 tokens) is under a block (16): every token computed, none cached.
    assert delta(after, "prompt_tokens_by_source_total", source="local_compute") == 3 * len(PROMPT)
    assert delta(after, "prompt_tokens_by_source_total", source="local_cache_hit") == 0
    assert delta(after, "prompt_tokens_by_source_total", source="external_kv_transfer") == 0
    assert delta(after, "prompt_tokens_cached_total") == delta(after, "prompt_tokens_recomputed_total") == 0
    assert delta(after, "request_prefill_kv_computed_tokens_sum") == 3 * len(PROMPT)
    assert delta(after, "request_prefill_kv_computed_tokens_bucket", le="10") == 0
    assert delta(after, "request_prefill_kv_computed_tokens_bucket", le="20") == 3
    assert delta(after, "request_success_total", finished_reason="stop") == 0
    token_bounds = sorted(
        float(dict(labels)["le"]) for name, labels in after if name == "xlaserve:request_prompt_tokens_bucket"
    )
    assert token_bounds == [1, 2, 5, 10, 20, 50, 100, float("inf")]
    ttft_bounds = {
        dict(labels)["le"] for name, labels in after if name == "xlaserve:time_to_first_token_seconds_bucket"
    }
    assert {"640.0", "2560.0"} <= ttft_bounds


def test_model_cards_are_vllms(admin_server):
    """/v1/models: vLLM's card, with root, max_model_len and a permission entry."""
    (card,) = httpx.get(admin_server.url + "/v1/models", headers=admin_server.headers).json()["data"]
    assert (card["id"], card["object"], card["max_model_len"], card["parent"]) == ("tiny", "model", 128, None)
    (permission,) = card["permission"]
    assert permission["object"] == "model_permission" and permission["id"].startswith("modelperm-")
    assert permission["allow_sampling"] and not permission["allow_fine_tuning"]


def test_a_callers_error_is_a_400_naming_it(admin_server, tmp_path):
    error = admin(admin_server, "POST", "/sleep", expect=400, params={"level": 3})["error"]
    assert "level" in error["message"]
    missing = str(tmp_path / "nowhere")
    error = admin(admin_server, "POST", "/update_weights_from_disk", expect=400, json={"model_path": missing})
    assert "nowhere" in error["error"]["message"]
    error = admin(admin_server, "POST", "/update_weights_from_disk", expect=400, json={"path": missing})
    assert error["error"]["param"] in ("model_path", "path")
    assert "not asleep" in admin(admin_server, "POST", "/wake_up", expect=400)["error"]["message"]
    complete(admin_server)  # the engine still serves


def test_the_admin_routes_need_the_key(admin_server):
    for path in ("/sleep", "/wake_up", "/reset_prefix_cache", "/update_weights_from_disk"):
        r = httpx.post(admin_server.url + path, json={"model_path": "x"}, timeout=30)
        assert r.status_code == 401, (path, r.text)
    assert httpx.get(admin_server.url + "/is_sleeping", timeout=30).status_code == 401


def test_the_log_says_what_the_engine_did(admin_server):
    """vLLM's periodic stats line (engine/engine/stat_logger.py; --disable-log-stats turns it off): after
    a request, a line with its generation throughput, then one idle line, and quiet after it."""
    complete(admin_server)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with open(admin_server.log_path, errors="replace") as f:
            lines = [line for line in f if "Avg prompt throughput" in line]
        if lines and "Avg generation throughput: 0.0 tokens/s, Running: 0 reqs" in lines[-1]:
            break  # the idle line, after the request's
        time.sleep(0.5)
    assert re.search(r"Avg generation throughput: [1-9][0-9.]* tokens/s, Running: \d+ reqs", "".join(lines))
    assert "Running: 0 reqs, Waiting: 0 reqs" in lines[-1]
    time.sleep(1.5)  # three intervals, idle
    with open(admin_server.log_path, errors="replace") as f:
        assert sum("Avg prompt throughput" in line for line in f) == len(lines)


def test_pages_of_allowed_origins_may_call_the_server(admin_server):
    """vLLM's CORS flags (--allowed-origins): a browser's preflight from the allowed page is granted
    without the API key (browsers send none); another page's is not; an answer to the allowed page (a
    401 without the key too) carries the grant, so its script can read the error. A server started
    without the flag grants no page (the next test's app)."""
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    granted = httpx.options(admin_server.url + "/v1/completions", headers={"Origin": ORIGIN, **preflight})
    assert granted.status_code == 200 and granted.headers["access-control-allow-origin"] == ORIGIN
    refused = httpx.options(
        admin_server.url + "/v1/completions", headers={"Origin": "https://x.example", **preflight}
    )
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    unauthorized = httpx.get(admin_server.url + "/v1/models", headers={"Origin": ORIGIN})
    assert unauthorized.status_code == 401 and unauthorized.headers["access-control-allow-origin"] == ORIGIN


def test_without_the_flags_there_are_no_admin_routes_and_no_cors_and_with_one_no_docs():
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from xlaserve.entrypoints.app import build_app
    from xlaserve.entrypoints.serving.state import ServerState

    engine = SimpleNamespace(
        tokenizer=None, model="tiny", max_model_len=64, vocab_size=128, is_errored=False,
        input_processor=SimpleNamespace(max_logprobs=5),  # the OpenAPI schema states its bound
    )  # fmt: skip
    client = TestClient(build_app(ServerState(engine=engine, served_model_names=["tiny"])))
    for path in ("/sleep", "/wake_up", "/reset_prefix_cache", "/update_weights_from_disk"):
        assert client.post(path).status_code == 404, path
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    assert "access-control-allow-origin" not in client.options("/v1/completions", headers=preflight).headers
    assert [client.get(path).status_code for path in ("/docs", "/openapi.json")] == [200, 200]
    # The logprob counts' bound is the engine's --max-logprobs, not a fixed one.
    models = client.get("/openapi.json").json()["components"]["schemas"]
    bounded = [
        ("CompletionRequest", "logprobs"),
        ("ChatCompletionRequest", "top_logprobs"),
        ("ChatCompletionRequest", "prompt_logprobs"),
        ("ResponsesRequest", "top_logprobs"),
    ]
    for model, field in bounded:
        integer = next(o for o in models[model]["properties"][field]["anyOf"] if o.get("type") == "integer")
        assert integer["maximum"] == 5, (model, field)
    quiet = TestClient(build_app(ServerState(engine=engine, served_model_names=["tiny"], enable_docs=False)))
    assert [quiet.get(path).status_code for path in ("/docs", "/redoc", "/openapi.json")] == [404] * 3
    assert client.get("/is_sleeping").status_code == 404


def test_the_flag_without_a_key_refuses_to_start(monkeypatch, capsys):
    monkeypatch.delenv("XLASERVE_API_KEY", raising=False)
    with pytest.raises((SystemExit, ValueError)) as e:
        status = cli.main(["serve", "--enable-admin-api"])
        raise SystemExit(status)
    assert getattr(e.value, "code", 1) != 0
    assert "--enable-admin-api needs --api-key" in (str(e.value) + capsys.readouterr().err)


# -- hostile input (test_server_hostile.py's checks, on the admin routes) ------------------------------


@pytest.fixture(scope="module")
def client(admin_server):
    """One keep-alive connection for the hostile cases."""
    with httpx.Client(base_url=admin_server.url, headers=admin_server.headers, timeout=120) as client:
        yield client


@pytest.mark.parametrize("value", WRONG_TYPES["string"])
def test_update_weights_wrong_type_is_400_naming_the_field(client, value):
    response, port = send(client, "/update_weights_from_disk", {"model_path": value})
    check_error(response, 400, "model_path")
    check_still_serving(client, port)


@pytest.mark.parametrize("name, raw", list(BAD_TEXT.items()))
def test_update_weights_invalid_unicode_is_400_naming_the_field(client, name, raw):
    content = body_with({"model_path": "/tmp/@"}, raw)
    response, port = send(
        client, "/update_weights_from_disk", content=content, headers={"Content-Type": "application/json"}
    )
    error = check_error(response, 400)
    assert error["param"] == "model_path" and error["code"] == "invalid_unicode", error
    check_still_serving(client, port)


UPDATE_WEIGHTS_BAD = [  # (body, the param named)
    ({}, "model_path"),
    ({"model_path": ""}, "model_path"),
    ({"model_path": "x", "extra": 1}, "extra"),
    ({"model_path": "a" * 5000}, "model_path"),
]


@pytest.mark.parametrize(
    "body, param", UPDATE_WEIGHTS_BAD, ids=[json.dumps(b)[:40] for b, _ in UPDATE_WEIGHTS_BAD]
)
def test_update_weights_bad_body_is_400(client, body, param):
    response, port = send(client, "/update_weights_from_disk", body)
    assert check_error(response, 400)["param"] == param
    check_still_serving(client, port)


def test_update_weights_from_a_missing_path_is_400(client, tmp_path):
    response, port = send(client, "/update_weights_from_disk", {"model_path": str(tmp_path / "nowhere")})
    check_error(response, 400)
    check_still_serving(client, port)


SLEEP_LEVELS_BAD = ["0", "3", "-1", "abc", "1.5", "true", "9" * 30]


@pytest.mark.parametrize("level", SLEEP_LEVELS_BAD)
def test_sleep_level_out_of_range_or_wrong_type_is_400(client, level):
    response = client.post("/sleep", params={"level": level})
    check_error(response, 400, "level")
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}


SLEEP_MODES_BAD = ["", "Abort", "pause", "1", "9" * 30]
RESET_RUNNING_REQUESTS_BAD = ["", "maybe", "2", "9" * 30]


@pytest.mark.parametrize("mode", SLEEP_MODES_BAD)
def test_sleep_mode_not_vllms_is_400(client, mode):
    response = client.post("/sleep", params={"mode": mode})
    check_error(response, 400, "mode")
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}


@pytest.mark.parametrize("value", RESET_RUNNING_REQUESTS_BAD)
def test_reset_running_requests_not_a_boolean_is_400(client, value):
    response = client.post("/reset_prefix_cache", params={"reset_running_requests": value})
    check_error(response, 400, "reset_running_requests")
