"""Disaggregated prefill's three processes (issue 35): a producer server, a consumer server and
`xlaserve router` in front, on loopback, driven by the official openai and anthropic clients. Through
the router a request answers like one server (greedy, token for token), with the prompt's blocks
loaded on the consumer (its fetch metrics and cached tokens say so): completions, chat, the Responses
API (a stored response continued, read back and deleted through the router; a background one) and
Anthropic's messages, streamed or not (a prompt sent again: not fetched, the consumer holds it whole),
and n > 1 samples sharing one fetch; bad requests get the
instances' own errors; a producer killed after its prefill leaves the consumer computing the prompt
itself; with no producer left the router sends requests to the consumer alone. The instances run with
`--api-key`: the client's key (Bearer, or Anthropic's x-api-key) goes on to both legs, and a key they
refuse is their 401, relayed; the router's own `--api-key` is checked before anything is routed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time

import anthropic
import httpx
import openai
import pytest

from helpers.sdk_clients import anthropic_prompt_tokens
from helpers.server_harness import ServerProcess, _command, _free_port
from helpers.tiny_models import TINY_PROCESS_ENV, save_tiny_thinking_model
from xlaserve.entrypoints.router import Router, build_app
from xlaserve.entrypoints.router_responses import ResponseOwners, _IdReader

BLOCK = 16
# A long prompt: several blocks travel.
PROMPT = "The quick brown fox jumps over the lazy dog, " * 6
GREEDY = {"temperature": 0.0, "max_tokens": 10}
KEY = "sk-disagg"  # the instances' --api-key
AUTH = {"Authorization": f"Bearer {KEY}"}
TINY_FLAGS = ["--enforce-eager", "--served-model-name", "tiny", "--max-num-batched-tokens", "64",
              "--max-num-seqs", "4", "--max-model-len", "256", "--block-size", str(BLOCK),
              "--enable-prompt-tokens-details"]  # fmt: skip


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
        api_key=KEY,
        model=model,
        env=TINY_PROCESS_ENV,
    )
    # The consumer gives up on a silent producer after 2 s (the killed-producer test waits that long).
    consumer = ServerProcess(
        logs,
        server_cache_dir,
        [*TINY_FLAGS, *_transfer_flags("kv_consumer", _free_port(), timeout_s=2.0)],
        api_key=KEY,
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
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _fetches(consumer) -> dict[str, float]:
    text = httpx.get(consumer.url + "/metrics").text
    counts = {}
    for line in text.splitlines():
        if line.startswith("xlaserve:kv_transfer_fetches_total{"):
            outcome = line.split('outcome="')[1].split('"')[0]
            counts[outcome] = float(line.rsplit(" ", 1)[1])
    return counts


def _num_prompt_tokens(server, prompt: str) -> int:
    return len(httpx.post(server.url + "/tokenize", json={"prompt": prompt}, headers=AUTH).json()["tokens"])


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
    response = httpx.post(router.url + "/v1/completions", content=b"{not json", headers=AUTH)
    assert response.status_code == 400 and "not JSON" in response.json()["error"]["message"]


def test_bench_serve_measures_the_router_against_one_server(servers, tmp_path):
    """`bench serve --peer-base-url`: a mixed load (long and short prompts) through the router and on
    the producer alone, with ratios; every routed request's blocks were loaded on the consumer."""
    producer, consumer, router = servers
    before = _fetches(consumer)
    out = tmp_path / "bench.json"
    subprocess.run(
        [*_command(), "bench", "serve", "--base-url", router.url, "--peer-base-url", producer.url,
         "--api-key", KEY, "--num-prompts", "4", "--output-len", "4", "--long-prompt-ratio", "0.5",
         "--long-prompt-len", "30", "--output-json", str(out)],
        check=True, timeout=300,
    )  # fmt: skip
    run = json.loads(out.read_text())["runs"][0]
    assert run["num_failed"] == 0 and run["peer"]["num_failed"] == 0 and run["num_long"] == 2
    assert {"ttft_s_long_p50", "tpot_s_short_p50", "output_tokens_per_s"} <= set(run["vs_peer"])
    # The four requests and the warm-up one; the first request's prompt is the warm-up's, which the
    # consumer holds whole: not fetched.
    assert _loaded_since(consumer, before) == (4, 0, 1)


def _cached(prompt_tokens: int) -> int:
    """The tokens a consumer loads: every full block before the prompt's last token."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


def _loaded_since(consumer, before: dict) -> tuple[float, float, float]:
    """(loaded, recomputed, cached) fetches on the consumer since `before` (cached: it held every block
    of the prompt, none fetched)."""
    after = _fetches(consumer)
    return tuple(after.get(o, 0) - before.get(o, 0) for o in ("loaded", "recomputed", "cached"))


RESPONSES_GREEDY = {"model": "tiny", "temperature": 0.0, "max_output_tokens": 10}


def test_responses_through_the_router_answer_like_one_server_and_continue(servers):
    """/v1/responses: the prefill leg, then the consumer, streamed or not; a stored response continued
    (previous_response_id: no prefill leg, the history in the consumer's prefix cache), read back and
    deleted through the router; a background response decoded on the consumer alone."""
    producer, consumer, router = servers
    routed, alone = _client(router.url).responses, _client(producer.url).responses
    prompt = "D " + PROMPT
    before = _fetches(consumer)
    first = routed.create(input=prompt, **RESPONSES_GREEDY)
    expected = alone.create(input=prompt, **RESPONSES_GREEDY)
    assert first.output_text == expected.output_text and first.status == expected.status
    assert first.usage.input_tokens_details.cached_tokens == _cached(first.usage.input_tokens)
    assert _loaded_since(consumer, before) == (1, 0, 0)
    assert "kv_transfer_params" not in first.model_dump()  # only a producer's answer carries them

    # Continued through the router: to the consumer that holds it, whose prefix cache has the history.
    before = _fetches(consumer)
    follow = routed.create(input="Go on.", previous_response_id=first.id, **RESPONSES_GREEDY)
    follow_alone = alone.create(input="Go on.", previous_response_id=expected.id, **RESPONSES_GREEDY)
    assert follow.output_text == follow_alone.output_text
    assert follow.usage.input_tokens == follow_alone.usage.input_tokens
    assert follow.usage.input_tokens_details.cached_tokens >= _cached(first.usage.input_tokens)
    assert _loaded_since(consumer, before) == (0, 0, 0)
    assert routed.retrieve(follow.id).output_text == follow.output_text
    routed.delete(first.id)  # the openai client returns nothing; a 404 would raise
    with pytest.raises(openai.NotFoundError):
        routed.retrieve(first.id)

    # Streamed: the events relayed; the response stored on the consumer, read back through the router.
    before = _fetches(consumer)
    events = list(routed.create(input=prompt, stream=True, **RESPONSES_GREEDY))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == expected.output_text and events[-1].type == f"response.{expected.status}"
    assert routed.retrieve(events[-1].response.id).output_text == text
    # The consumer holds the prompt whole (the first request's blocks): nothing fetched.
    assert _loaded_since(consumer, before) == (0, 0, 1)

    # In the background: answered queued at once, decoded on the consumer alone, polled to the answer.
    before = _fetches(consumer)
    queued = routed.create(input=prompt, background=True, **RESPONSES_GREEDY)
    deadline = time.monotonic() + 60
    while (done := routed.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert done.output_text == expected.output_text
    assert _loaded_since(consumer, before) == (0, 0, 0)
    # Its events followed again through the router (the query relayed): after the first, to the end.
    again = list(routed.retrieve(queued.id, stream=True, starting_after=0))
    assert again[0].sequence_number == 1 and again[-1].type == f"response.{expected.status}"
    assert again[-1].response.output_text == expected.output_text


def test_anthropic_messages_through_the_router_answer_like_one_server(servers):
    producer, consumer, router = servers
    # Anthropic's client sends its key as x-api-key: the router sends that on.
    routed = anthropic.Anthropic(base_url=router.url, api_key=KEY, max_retries=0, timeout=120)
    alone = anthropic.Anthropic(base_url=producer.url, api_key=KEY, max_retries=0, timeout=120)
    fields = {"model": "tiny", "max_tokens": 10, "messages": [{"role": "user", "content": "E " + PROMPT}]}
    greedy = {"temperature": 0}
    before = _fetches(consumer)
    message = routed.messages.create(**fields, extra_body=greedy)
    expected = alone.messages.create(**fields, extra_body=greedy)
    assert message.content == expected.content
    # Not cache_read_input_tokens: the consumer's count is the blocks it fetched, the producer's its hit.
    assert (anthropic_prompt_tokens(message.usage), message.usage.output_tokens) == (
        anthropic_prompt_tokens(expected.usage),
        expected.usage.output_tokens,
    )
    assert _loaded_since(consumer, before) == (1, 0, 0)
    assert "kv_transfer_params" not in message.model_dump()
    # Anthropic's event stream, relayed.
    before = _fetches(consumer)
    with routed.messages.stream(**fields, extra_body=greedy) as stream:
        streamed = stream.get_final_message()
    assert [b.text for b in streamed.content] == [b.text for b in expected.content]
    assert streamed.stop_reason == expected.stop_reason
    assert _loaded_since(consumer, before) == (0, 0, 1)  # the same prompt: held whole, not fetched
    # count_tokens: any instance counts.
    counted = routed.messages.count_tokens(model="tiny", messages=fields["messages"])
    assert counted.input_tokens == anthropic_prompt_tokens(expected.usage)


def test_n_samples_take_the_prefill_leg_and_share_its_fetch(servers):
    """n > 1: the prefill leg asks for one sample (and drops min_tokens, which max_tokens=1 would
    refuse); the consumer's n samples share that one fetch. A beam search goes to the consumer alone."""
    producer, consumer, router = servers
    prompt = "F " + PROMPT
    fields = {"model": "tiny", "prompt": prompt, "extra_body": {"min_tokens": 2}, **GREEDY}
    before = _fetches(consumer)
    # top_k=1: greedy, but sampled (n > 1 at temperature 0 is refused, as vLLM does).
    sampled = {**fields, "temperature": 1.0, "extra_body": {"min_tokens": 2, "top_k": 1}}
    routed = _client(router.url).completions.create(n=3, **sampled)
    alone = _client(producer.url).completions.create(**fields)
    assert [c.text for c in routed.choices] == [alone.choices[0].text] * 3
    assert _loaded_since(consumer, before) == (1, 0, 0)
    beams = httpx.post(
        router.url + "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "n": 2, "use_beam_search": True, "max_tokens": 3},
        headers=AUTH,
        timeout=120,
    )
    assert beams.status_code == 200 and len(beams.json()["choices"]) == 2, beams.text
    assert _loaded_since(consumer, before) == (1, 0, 0)


def test_bad_requests_get_the_instances_own_errors_through_the_router(servers):
    """A request the prefill leg refuses gets the producer's error, one only the consumer can judge
    (a response it does not hold) the consumer's, unchanged; the router's own in the API's shape."""
    producer, consumer, router = servers
    cases = [
        ("/v1/responses", {"model": "tiny", "input": "Hi", "temperature": 5.0}, producer, 400),
        ("/v1/responses", {"model": "tiny", "input": "Hi", "previous_response_id": "resp_x"}, consumer, 404),
        ("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
                          "temperature": 1.5}, producer, 400),
    ]  # fmt: skip
    for path, body, instance, status in cases:
        through = httpx.post(router.url + path, json=body, headers=AUTH, timeout=120)
        direct = httpx.post(instance.url + path, json=body, headers=AUTH, timeout=120)
        assert through.status_code == direct.status_code == status, through.text
        assert through.json() == direct.json()
    response = httpx.get(router.url + "/v1/responses/resp_nowhere", headers=AUTH)
    assert response.status_code == 404 and response.json()["error"]["code"] == "response_not_found"
    response = httpx.post(router.url + "/v1/messages", content=b"{not json", headers=AUTH)
    assert response.status_code == 400 and response.json()["type"] == "error"
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_a_key_the_instances_refuse_is_their_401_through_the_router(servers):
    """Without the key, or with a wrong one (Bearer or x-api-key), each route answers what the instance
    it reaches answers: the prefill leg's producer, the decode instance, the instance searched for a
    stored response; in the route's error shape (Anthropic's on /v1/messages)."""
    producer, consumer, router = servers
    chat = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    cases = [
        ("POST", "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 4}, producer),
        ("POST", "/v1/chat/completions", chat, producer),
        ("POST", "/v1/messages", chat, producer),
        ("POST", "/v1/responses", {"model": "tiny", "input": "Hi"}, producer),
        ("GET", "/v1/responses/resp_x", None, consumer),
        ("GET", "/v1/models", None, consumer),
    ]
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"x-api-key": "sk-wrong"}):
        for method, path, body, instance in cases:
            through = httpx.request(method, router.url + path, json=body, headers=headers, timeout=60)
            direct = httpx.request(method, instance.url + path, json=body, headers=headers, timeout=60)
            assert through.status_code == direct.status_code == 401, (path, through.text)
            assert through.json() == direct.json()
            error = through.json()["error"]
            assert error["type"] == "authentication_error", (path, error)
    # The right key as x-api-key (Anthropic's way) is sent on too, on any route.
    models = httpx.get(router.url + "/v1/models", headers={"x-api-key": KEY}, timeout=60)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
    # Anthropic's SDK (its version header) gets Anthropic's shape of the list, as from an instance.
    anthropic = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    models = httpx.get(router.url + "/v1/models", headers=anthropic, timeout=60)
    direct = httpx.get(consumer.url + "/v1/models", headers=anthropic, timeout=60)
    assert models.status_code == 200 and models.json()["data"][0]["type"] == "model"
    assert models.json() == direct.json()


def test_the_routers_own_key_is_checked_before_routing():
    """`--api-key` on the router: a missing or wrong key is its 401 (in the route's shape), before any
    instance is tried (here none answers: a right key gets the 503 of no decode instance); /health is
    open."""
    router = Router([], [f"http://127.0.0.1:{_free_port()}"])
    app = build_app(router, api_key=KEY)

    async def ask(method: str, path: str, headers: dict) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            return await client.request(method, path, json={"model": "tiny", "prompt": "Hi"}, headers=headers)

    async def run():
        answers = {}
        for name, headers in [("none", {}), ("wrong", {"Authorization": "Bearer x"}), ("right", AUTH),
                              ("right-x", {"x-api-key": KEY})]:  # fmt: skip
            for path in ("/v1/completions", "/v1/messages"):
                answers[name, path] = await ask("POST", path, headers)
        answers["health"] = await ask("GET", "/health", {})
        await router.client.aclose()
        return answers

    answers = asyncio.run(run())
    for name in ("none", "wrong"):
        openai_shape, anthropic_shape = answers[name, "/v1/completions"], answers[name, "/v1/messages"]
        assert openai_shape.status_code == anthropic_shape.status_code == 401
        assert openai_shape.json()["error"]["code"] == "invalid_api_key"
        assert anthropic_shape.json()["type"] == "error"
        assert anthropic_shape.json()["error"]["type"] == "authentication_error"
    for name in ("right", "right-x"):
        assert answers[name, "/v1/completions"].status_code == 503
        assert "no decode instance" in answers[name, "/v1/completions"].json()["error"]["message"]
        assert answers[name, "/v1/messages"].json()["error"]["type"] == "overloaded_error"
    assert answers["health"].status_code == 503  # open (no key asked), and no instance is up


def test_the_router_reads_a_response_id_from_any_answer():
    """The id a decode instance answered: from a whole response, or from a stream's first event however
    its bytes are cut (no servers)."""
    owners = ResponseOwners(max_size=2)
    _IdReader(owners)("a", b'{"id": "resp_1", "object": "response"}')
    stream = b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_2"}}\n\n'
    reader = _IdReader(owners)
    assert [reader("b", stream[i : i + 7]) for i in range(0, len(stream), 7)][-1] is True
    assert owners.get("resp_1") == "a" and owners.get("resp_2") == "b"
    owners.remember("resp_3", "c")  # the least recently used forgotten
    assert owners.get("resp_1") is None and owners.get("resp_3") == "c"


def test_a_killed_producer_leaves_the_consumer_computing_and_the_router_routing(servers):
    producer, consumer, router = servers
    prompt = "B " + PROMPT
    expected = _client(consumer.url).completions.create(model="tiny", prompt=prompt, **GREEDY).choices[0].text
    prompt = "C " + PROMPT  # not in the consumer's prefix cache beyond its first block
    # The producer prefills and holds the blocks, then dies before the consumer fetches them.
    prefilled = httpx.post(
        producer.url + "/v1/completions",
        headers=AUTH,
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
    answer = httpx.post(consumer.url + "/v1/completions", json=body, headers=AUTH, timeout=120).json()
    alone = _client(consumer.url).completions.create(model="tiny", prompt=prompt, **GREEDY).choices[0].text
    assert answer["choices"][0]["text"] == alone  # computed on the consumer, nothing lost
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # its first token differs
    assert _fetches(consumer)["recomputed"] == before.get("recomputed", 0) + 1
    # Through the router now: no producer answers, the consumer alone serves the request.
    routed = _client(router.url).completions.create(model="tiny", prompt="B " + PROMPT, **GREEDY)
    assert routed.choices[0].text == expected
