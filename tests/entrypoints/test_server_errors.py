"""Every error the server answers, as OpenAI's error JSON with the right status and `param`; and
schemathesis against the server's own OpenAPI schema: no 5xx, no response outside the schema."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from helpers.server_harness import MODEL_NAME

CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120)


def post(server, path: str, headers: dict | None = None, **kwargs) -> httpx.Response:
    return httpx.post(
        server.url + path, headers=server.headers if headers is None else headers, timeout=120, **kwargs
    )


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert len(error["message"]) <= 500
    assert "Traceback" not in error["message"] and "/work/" not in error["message"]
    return error


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
        ("/v1/completions", {"prompt": "x", "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ("/v1/completions", {"prompt": [1, 2, 10**9]}, "prompt"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"max_tokens": 4}, "prompt"),
        ("/v1/completions", {"prompt": "x", "frobnicate": True}, "frobnicate"),
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
        ("/v1/completions", {"prompt": "x", "request_id": "r" * 129}, "request_id"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "response_format": {"type": "xml"}},
            "response_format.type",
        ),
        ("/v1/chat/completions", {"messages": CHAT, "tools": []}, "tools"),
        ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "stream": "yes please"}, "stream"),
        ("/v1/chat/completions", {"messages": CHAT, "request_id": "tab\there"}, "request_id"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ],
)
def test_invalid_field_is_400_naming_it(server, path, body, param):
    error = error_of(post(server, path, json=body), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_malformed_json_and_non_objects_are_400(server):
    error = error_of(
        post(
            server,
            "/v1/completions",
            content=b'{"prompt": "x"',
            headers={**server.headers, "Content-Type": "application/json"},
        ),
        400,
    )
    assert error["code"] == "invalid_json"
    error_of(post(server, "/v1/completions", json=["a list"]), 400)


def test_schema_error_messages_are_bounded(server):
    huge = "y" * 1_000_000
    error = error_of(
        post(
            server,
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": huge, "extra": huge}]},
        ),
        400,
    )
    assert "yyyy" not in error["message"]


def test_context_length_is_400_with_both_numbers(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="hello " * 300, max_tokens=300)
    assert e.value.status_code == 400 and e.value.param == "max_tokens"
    assert "512" in e.value.message and "601" in e.value.message and "300" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # a huge prompt: bounded tokenizer work
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "word " * 400_000}]
        )
    assert e.value.param == "messages" and "512" in e.value.message


def test_api_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": server.api_key}):
        error = error_of(httpx.get(server.url + "/v1/models", headers=headers), 401)
        assert error["type"] == "authentication_error"
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_unknown_model_and_route_are_404(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=CHAT)
    assert e.value.param == "model"
    error_of(httpx.get(server.url + "/v1/nothing-here", headers=server.headers), 404)
    error_of(httpx.get(server.url + "/v1/models/gpt-4", headers=server.headers), 404)


def test_openapi_schema_has_no_422(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    for path in schema["paths"].values():
        for operation in path.values():
            assert "422" not in operation["responses"]


# -- schemathesis ------------------------------------------------------------------------------------

NUM_EXAMPLES = 12  # per operation; each POST that passes validation generates a few tokens


@pytest.fixture
def api_schema(server):
    loaded = schemathesis.openapi.from_url(server.url + "/openapi.json")
    loaded.config.generation.update(max_examples=NUM_EXAMPLES)
    return loaded


schema = schemathesis.pytest.from_fixture("api_schema")


def _cap_work(case) -> None:
    """Keep generated requests cheap: a few tokens, few choices (values stay schema-valid)."""
    body = case.body
    if not isinstance(body, dict) or not case.path.endswith(("completions", "/v1/messages", "/v1/responses")):
        return
    if case.path.endswith("/v1/responses"):
        if not isinstance(body.get("max_output_tokens"), int) or body["max_output_tokens"] > 2:
            body["max_output_tokens"] = 2
        body["store"] = False
        return
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and body[key] > 2:
            body[key] = 2
    body.setdefault("max_tokens", 2)
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2
    if isinstance(body.get("min_tokens"), int) and body["min_tokens"] > 2:
        body["min_tokens"] = 0


@pytest.mark.slow
@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
def test_schemathesis_no_5xx_no_schema_violation(case, server):
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    _cap_work(case)
    case.call_and_validate(
        headers=server.headers,
        timeout=120,
        checks=[
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_schema_conformance,
        ],
    )


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": ["Hello", "Bonjour"], "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    ],
)
def test_streamed_events_match_the_schemas_event_stream_entry(server, path, body):
    """OpenAPI before 3.2 has a text/event-stream `schema` describe each event; schema checkers
    (schemathesis) read every event against it: the declared one must be an event's shape, not a string."""
    import jsonschema

    declared = httpx.get(server.url + "/openapi.json", timeout=60).json()["paths"][path]["post"]["responses"]
    event_schema = declared["200"]["content"]["text/event-stream"]["schema"]
    reply = post(server, path, json={"model": MODEL_NAME, "stream": True, "temperature": 0, **body})
    assert reply.status_code == 200
    events = [
        {"data": line.removeprefix("data: ")} for line in reply.text.split("\n") if line.startswith("data: ")
    ]
    assert len(events) >= 3 and events[-1]["data"] == "[DONE]"
    for event in events:
        jsonschema.validate({**event, "event": "message"}, event_schema)


def _stand_in_client(max_logprobs: int):
    """The app in-process around a stand-in engine of a 128-token vocabulary: the logprob checks come
    before a route asks the engine for anything else."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from xlaserve.engine.processor import InputProcessor
    from xlaserve.entrypoints.app import build_app
    from xlaserve.entrypoints.serving.state import ServerState

    engine = SimpleNamespace(
        tokenizer=SimpleNamespace(), model="tiny", max_model_len=64, vocab_size=128, is_errored=False,
        input_processor=InputProcessor(None, 64, 128, None, 0, max_logprobs=max_logprobs),
    )  # fmt: skip
    return TestClient(build_app(ServerState(engine=engine, served_model_names=["tiny"]))), engine


def test_minus_one_logprobs_are_the_whole_vocabulary():
    """vLLM's -1 (completions' logprobs, chat's top_logprobs, prompt_logprobs): every token of the
    vocabulary, so past a max_logprobs below it a 400 naming the field; -2 is a 400 of its own. Where the
    engine allows the vocabulary, the route reads -1 as its size (the engine's entries:
    tests/models/test_skip_tokenizer_init.py)."""
    from xlaserve.entrypoints.openai.protocol import CompletionRequest
    from xlaserve.entrypoints.serving.engine_io import resolve_num_logprobs

    client, _ = _stand_in_client(max_logprobs=5)
    for path, body, param in [
        ("/v1/completions", {"prompt": [5, 6], "logprobs": -1}, "logprobs"),
        ("/v1/completions", {"prompt": [5, 6], "prompt_logprobs": -1}, "prompt_logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": -1}, "prompt_logprobs"),
        ("/v1/responses", {"input": "hi", "top_logprobs": -1}, "top_logprobs"),  # vLLM's Responses too
    ]:
        error = error_of(client.post(path, json={"model": "tiny", **body}), 400)
        assert error["param"] == param and error["message"] == (
            f"{param} must be at most 5 (the engine's max_logprobs), got -1 (the whole vocabulary, 128)"
        ), error
        body = {**body, param: -2}
        assert error_of(client.post(path, json={"model": "tiny", **body}), 400)["param"] == param
    _, engine = _stand_in_client(max_logprobs=128)
    req = CompletionRequest(prompt=[5, 6], logprobs=-1, prompt_logprobs=-1)
    resolve_num_logprobs(engine, req, "logprobs", "prompt_logprobs")
    assert (req.logprobs, req.prompt_logprobs) == (128, 128)


def test_logprob_counts_past_the_engines_max_logprobs_are_400_naming_the_field():
    """The bound is the engine's --max-logprobs (here 5), not a fixed 20: each route's field past it is
    a 400 naming the field and the limit (test_admin_api.py: the OpenAPI schema states it). The app runs
    in-process around a stand-in engine: these checks come before a route asks the engine for anything
    else."""
    client, _ = _stand_in_client(max_logprobs=5)
    for path, body, param in [
        ("/v1/completions", {"prompt": [5, 6], "logprobs": 6}, "logprobs"),
        ("/v1/completions", {"prompt": [5, 6], "prompt_logprobs": 6}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": [5, 6], "n": 3, "use_beam_search": True}, "n"),
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 6}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": 6}, "prompt_logprobs"),
        ("/v1/responses", {"input": "hi", "top_logprobs": 6}, "top_logprobs"),
    ]:
        error = error_of(client.post(path, json={"model": "tiny", **body}), 400)
        assert error["param"] == param and re.search(
            r"(\b5\b.*max_logprobs|max_logprobs, 5\))", error["message"]
        ), error


def test_vllms_sampling_rules_over_http():
    """vLLM's SamplingParams rules, as its routes apply them: n > 1 at temperature 0 is a 400 naming `n`
    (a beam search's n is its width: allowed), and a logit_bias past [-100, 100] is clamped, not
    refused (SamplingParams.from_optional)."""
    from xlaserve.entrypoints.openai.protocol import CompletionRequest
    from xlaserve.entrypoints.serving.engine_io import make_sampling_params

    client, _ = _stand_in_client(max_logprobs=5)
    body = {"model": "tiny", "prompt": [5, 6], "n": 2, "temperature": 0}
    error = error_of(client.post("/v1/completions", json=body), 400)
    assert (error["param"], error["message"]) == ("n", "n must be 1 when using greedy sampling, got 2"), error
    req = CompletionRequest(prompt=[5, 6], logit_bias={"5": 250.5, "6": -1e9, "7": -3.5})
    assert make_sampling_params(req, 4, None).logit_bias == {5: 100.0, 6: -100.0, 7: -3.5}
    beams = CompletionRequest(prompt=[5, 6], n=3, temperature=0.0, use_beam_search=True)
    assert make_sampling_params(beams, 4, None).n == 1
