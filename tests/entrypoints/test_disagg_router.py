"""Disaggregated prefill's three processes (issue 35): a producer server, a consumer server and
`xlaserve router` in front, on loopback, driven by the official openai client. Through the router a
request answers like one server (greedy, token for token), with the prompt's blocks loaded on the
consumer (its cached tokens say so); a producer killed after its prefill leaves the consumer
computing the prompt itself; with no producer left the router sends requests to the consumer alone.
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

from helpers.server_harness import ServerProcess, _command, _free_port
from helpers.tiny_models import TINY_PROCESS_ENV, save_tiny_thinking_model

BLOCK = 16
# A long prompt: several blocks travel.
PROMPT = "The quick brown fox jumps over the lazy dog, " * 6
GREEDY = {"temperature": 0.0, "max_tokens": 10}
TINY_FLAGS = ["--enforce-eager", "--served-model-name", "tiny", "--max-num-batched-tokens", "64",
              "--max-num-seqs", "4", "--max-model-len", "256", "--block-size", str(BLOCK)]  # fmt: skip


def _transfer_flags(role: str, port: int, **extra) -> list[str]:
    config = {"kv_connector": "JaxConnector", "kv_role": role, "kv_port": port}
    if extra:
        config["kv_connector_extra_config"] = extra
    return ["--kv-transfer-config", json.dumps(config)]


class RouterProcess:
    def __init__(self, log_dir: str, prefill: list[str], decode: list[str]):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [f"--prefill={u}" for u in prefill] + [f"--decode={u}" for u in decode]
        self._log = open(os.path.join(log_dir, "router.log"), "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [*_command(), "router", "--port", str(self.port), "--retry-after", "60", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        pytest.fail("the router did not start")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=30)
        self._log.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory, server_cache_dir):
    model = save_tiny_thinking_model(str(tmp_path_factory.mktemp("tiny-disagg")))
    logs = str(tmp_path_factory.mktemp("disagg-logs"))
    producer = ServerProcess(
        logs,
        server_cache_dir,
        [*TINY_FLAGS, *_transfer_flags("kv_producer", _free_port())],
        model=model,
        env=TINY_PROCESS_ENV,
    )
    # The consumer gives up on a silent producer after 2 s (the killed-producer test waits that long).
    consumer = ServerProcess(
        logs,
        server_cache_dir,
        [*TINY_FLAGS, *_transfer_flags("kv_consumer", _free_port(), timeout_s=2.0)],
        model=model,
        env=TINY_PROCESS_ENV,
    )
    producer.wait_ready()
    consumer.wait_ready()
    router = RouterProcess(logs, [producer.url], [consumer.url])
    yield producer, consumer, router
    router.stop()
    for proc in (producer, consumer):
        if proc.proc.poll() is None:
            assert proc.stop() == 0, proc.log_tail()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def _fetches(consumer) -> dict[str, float]:
    text = httpx.get(consumer.url + "/metrics").text
    counts = {}
    for line in text.splitlines():
        if line.startswith("xlaserve:kv_transfer_fetches_total{"):
            outcome = line.split('outcome="')[1].split('"')[0]
            counts[outcome] = float(line.rsplit(" ", 1)[1])
    return counts


def _num_prompt_tokens(server, prompt: str) -> int:
    return len(httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"])


def test_the_router_answers_like_one_server(servers):
    producer, consumer, router = servers
    prompt = "A " + PROMPT
    before = _fetches(consumer)
    routed = _client(router.url).completions.create(model="tiny", prompt=prompt, **GREEDY)
    alone = _client(producer.url).completions.create(model="tiny", prompt=prompt, **GREEDY)
    assert routed.choices[0].text == alone.choices[0].text  # token for token, as one server answers
    n = _num_prompt_tokens(consumer, prompt)
    # Every full block before the last prompt token came from the producer.
    assert routed.usage.prompt_tokens_details.cached_tokens == (n - 1) // BLOCK * BLOCK
    after = _fetches(consumer)
    assert after["loaded"] - before.get("loaded", 0) == 1 and after["recomputed"] == before.get(
        "recomputed", 0
    )

    # Chat, streamed through the router, against the producer alone.
    messages = [{"role": "user", "content": PROMPT}]
    extra = {"chat_template_kwargs": {"enable_thinking": False}}
    stream = _client(router.url).chat.completions.create(
        model="tiny", messages=messages, stream=True, extra_body=extra, **GREEDY
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    direct = _client(producer.url).chat.completions.create(
        model="tiny", messages=messages, extra_body=extra, **GREEDY
    )
    assert text == direct.choices[0].message.content
    assert _fetches(consumer)["loaded"] == after["loaded"] + 1


def test_bad_requests_pass_through_the_router_as_400(servers):
    _, _, router = servers
    with pytest.raises(openai.BadRequestError) as e:
        _client(router.url).completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=5.0)
    assert e.value.body["param"] == "temperature"
    response = httpx.post(router.url + "/v1/completions", content=b"{not json")
    assert response.status_code == 400 and "not JSON" in response.json()["error"]["message"]


def test_bench_serve_measures_the_router_against_one_server(servers, tmp_path):
    """`bench serve --peer-base-url`: a mixed load (long and short prompts) through the router and on
    the producer alone, with ratios; every routed request's blocks were loaded on the consumer."""
    producer, consumer, router = servers
    before = _fetches(consumer)
    out = tmp_path / "bench.json"
    subprocess.run(
        [*_command(), "bench", "serve", "--base-url", router.url, "--peer-base-url", producer.url,
         "--num-prompts", "4", "--output-len", "4", "--long-prompt-ratio", "0.5", "--long-prompt-len", "30",
         "--output-json", str(out)],
        check=True, timeout=300,
    )  # fmt: skip
    run = json.loads(out.read_text())["runs"][0]
    assert run["num_failed"] == 0 and run["peer"]["num_failed"] == 0 and run["num_long"] == 2
    assert {"ttft_s_long_p50", "tpot_s_short_p50", "output_tokens_per_s"} <= set(run["vs_peer"])
    assert _fetches(consumer)["loaded"] - before["loaded"] == 5  # the four requests and the warm-up one


def test_a_killed_producer_leaves_the_consumer_computing_and_the_router_routing(servers):
    producer, consumer, router = servers
    prompt = "B " + PROMPT
    expected = _client(consumer.url).completions.create(model="tiny", prompt=prompt, **GREEDY).choices[0].text
    prompt = "C " + PROMPT  # not in the consumer's prefix cache beyond its first block
    # The producer prefills and holds the blocks, then dies before the consumer fetches them.
    prefilled = httpx.post(
        producer.url + "/v1/completions",
        json={
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True},
        },
    ).json()
    params = prefilled["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_request_id"]
    producer.proc.kill()
    producer.proc.wait(timeout=30)
    before = _fetches(consumer)
    body = {"model": "tiny", "prompt": prompt, **GREEDY, "kv_transfer_params": params}
    answer = httpx.post(consumer.url + "/v1/completions", json=body, timeout=120).json()
    alone = _client(consumer.url).completions.create(model="tiny", prompt=prompt, **GREEDY).choices[0].text
    assert answer["choices"][0]["text"] == alone  # computed on the consumer, nothing lost
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # its first token differs
    assert _fetches(consumer)["recomputed"] == before.get("recomputed", 0) + 1
    # Through the router now: no producer answers, the consumer alone serves the request.
    routed = _client(router.url).completions.create(model="tiny", prompt="B " + PROMPT, **GREEDY)
    assert routed.choices[0].text == expected
