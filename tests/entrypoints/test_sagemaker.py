"""SageMaker's routes on `xlaserve serve` (the session's SmolLM2 server): GET /ping, and POST
/invocations routing a body by its shape (messages: chat completions, prompt: completions), answered as
the OpenAI route answers the same body, greedy, streamed too."""

from __future__ import annotations

import json

import httpx
import pytest

from helpers.server_harness import MODEL_NAME

CHAT = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "Name three colors."}],
    "max_tokens": 12,
}
PROMPT = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 8}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=300) as client:
        yield client


def test_ping_is_open_and_200(server):
    """SageMaker checks /ping without credentials, as /health is checked."""
    for method in ("GET", "POST"):
        response = httpx.request(method, server.url + "/ping")
        assert response.status_code == 200 and response.json() == {"status": "ok"}


@pytest.mark.parametrize(
    "body, path", [(CHAT, "/v1/chat/completions"), (PROMPT, "/v1/completions")], ids=["chat", "completions"]
)
def test_invocations_answers_as_the_route_the_body_shape_names(client, body, path):
    body = {**body, **GREEDY}
    invoked = client.post("/invocations", json=body)
    direct = client.post(path, json=body)
    assert invoked.status_code == direct.status_code == 200, invoked.text
    invoked, direct = invoked.json(), direct.json()
    assert (
        invoked["object"]
        == direct["object"]
        == ("chat.completion" if "messages" in body else "text_completion")
    )
    assert invoked["choices"] == direct["choices"]
    counts = ("prompt_tokens", "completion_tokens")  # the second may hit the prefix cache: counts only
    assert [invoked["usage"][k] for k in counts] == [direct["usage"][k] for k in counts]
    assert invoked["usage"]["completion_tokens"] == body["max_tokens"]


def _streamed_text(client, path: str, body: dict) -> str:
    text, events = "", []
    with client.stream("POST", path, json={**body, **GREEDY, "stream": True}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith(
            "text/event-stream"
        )
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        text += json.loads(event)["choices"][0]["delta"].get("content") or ""
    return text


def test_invocations_streams_a_chat(client):
    streamed = _streamed_text(client, "/invocations", CHAT)
    assert streamed and streamed == _streamed_text(client, "/v1/chat/completions", CHAT)


@pytest.mark.parametrize("body", [{}, {"input": "Hi"}, {"model": MODEL_NAME, "text": "Hi"}])
def test_invocations_with_another_shape_is_400_naming_what_it_expects(client, body):
    response = client.post("/invocations", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_body"
    assert "'messages'" in error["message"] and "'prompt'" in error["message"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({**CHAT, "messages": [{"role": "robot", "content": "Hi"}]}, "messages[0].role"),
        ({**CHAT, "max_tokens": "8"}, "max_tokens"),
        ({**PROMPT, "echo": "yes"}, "echo"),
        ({**PROMPT, "max_tokens": 10_000}, "max_tokens"),
        ({**CHAT, "prompt": "Hi"}, "prompt"),  # a chat body: prompt is not one of its fields
    ],
)
def test_invocations_errors_name_the_field_as_the_route_would(client, body, param):
    response = client.post("/invocations", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_invocations_needs_the_key(server):
    response = httpx.post(server.url + "/invocations", json=CHAT)
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
