"""Tool calling through `xlaserve serve` (the session's SmolLM2 server, which runs with
--enable-auto-tool-choice --tool-call-parser hermes) and the official `openai` client: forced calls
whose arguments validate against the tool's schema, a full round trip, and streams that agree with
the one-shot answers."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from helpers.sdk_clients import strict_openai
from helpers.server_harness import MODEL_NAME

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "pattern": "^[A-Z][a-z]{2,8}/[A-Z][a-z]{2,8}$"}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time in a zone", "parameters": TIME},
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]
GREEDY = {"temperature": 0.0, "max_tokens": 40}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return strict_openai(server)


def check_calls(choice, *, names=None) -> list:
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls, choice.message
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return calls


def streamed(client, **kwargs):
    """(content, reasoning, [(name, arguments)], finish_reason) from a stream, checking its format."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL_NAME, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.type == "function" and tc.function.name, tc
                    calls[tc.index] = [tc.function.name, ""]
                else:
                    assert tc.id is None and tc.function.name is None, "id and name come once"
                calls[tc.index][1] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(c) for c in calls.values()], finish


def test_required_returns_valid_calls(client):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0.0, max_tokens=120
    )  # SmolLM2 calls both tools: about 65 tokens
    check_calls(response.choices[0], names=set(SCHEMAS))
    assert not response.choices[0].message.content


def test_named_tool_returns_one_valid_call(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice=named, **GREEDY
    )
    (call,) = check_calls(response.choices[0], names={"get_time"})
    assert call.function.name == "get_time"


def test_parallel_tool_calls_false_gives_one_call(client):
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=2, temperature=1.0,
        seed=5, max_tokens=60,
    )  # fmt: skip
    for choice in response.choices:
        assert len(check_calls(choice)) == 1


@pytest.mark.parametrize("tool_choice", [NAMED_WEATHER, "auto"])
def test_stream_agrees_with_one_shot(client, tool_choice):
    kwargs = dict(messages=ASK, tools=TOOLS, tool_choice=tool_choice, seed=1, temperature=0.8, max_tokens=30)
    one_shot = client.chat.completions.create(model=MODEL_NAME, **kwargs).choices[0]
    content, calls, finish = streamed(client, **kwargs)
    assert calls == [(c.function.name, c.function.arguments) for c in one_shot.message.tool_calls or []]
    assert (content or None) == one_shot.message.content
    assert finish == one_shot.finish_reason


@pytest.mark.parametrize(("tool_choice", "max_tokens"), [("required", 28), (NAMED_WEATHER, 8)])
def test_forced_call_cut_by_max_tokens_is_length_streamed_or_not(client, tool_choice, max_tokens):
    """A forced call list that max_tokens cuts: calls only (never its raw JSON as content), the cut
    call's arguments as far as they went, finish_reason "length"; the stream accumulates to the same."""
    kwargs = dict(messages=ASK, tools=TOOLS, tool_choice=tool_choice, temperature=0.0, max_tokens=max_tokens)
    one_shot = client.chat.completions.create(model=MODEL_NAME, **kwargs).choices[0]
    content, calls, finish = streamed(client, **kwargs)
    assert one_shot.finish_reason == finish == "length"
    assert one_shot.message.content is None and not content
    assert calls == [(c.function.name, c.function.arguments) for c in one_shot.message.tool_calls]
    assert calls and calls[0][0] == "get_weather", one_shot


def test_round_trip(server, client):
    """Call, tool result, final answer; the assistant message goes back as the client got it."""
    first = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        **GREEDY,
    )
    (call,) = check_calls(first.choices[0])
    history = [
        *ASK,
        first.choices[0].message,  # the client's own model, serialised by the client
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sunny", "high_c": 24})},
    ]
    final = client.chat.completions.create(
        model=MODEL_NAME, messages=history, tools=TOOLS, tool_choice="none", **GREEDY
    )
    choice = final.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.content
    assert not choice.message.tool_calls
    # the history reached the template: the prompt holds the call and its result
    sent = [*ASK, first.choices[0].message.model_dump(exclude_none=True), history[2]]
    body = {"messages": sent, "tools": TOOLS}
    tokens = httpx.post(server.url + "/tokenize", json=body, headers=server.headers).json()
    assert final.usage.prompt_tokens == tokens["count"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}, headers=server.headers)
    assert all(word in text.json()["prompt"] for word in ("<tool_call>", '"get_weather"', "sunny", "Paris"))


def test_auto_reads_hermes_calls(client):
    """tool_choice auto: the hermes parser reads the model's text. SmolLM2 seldom calls on its own, so
    a regex holds its text to the format (two calls after a sentence): the answer has both calls and
    the sentence as content, streamed in pieces that agree."""
    call = r'\{"name": "get_weather", "arguments": \{"city": "(Paris|Tokyo)", "days": [1-7]\}\}'
    regex = rf"Checking\.\n<tool_call>\n{call}\n</tool_call>\n<tool_call>\n{call}\n</tool_call>"
    kwargs = dict(
        messages=ASK, tools=TOOLS, tool_choice="auto", temperature=0.0, max_tokens=80,
        extra_body={"structured_outputs": {"regex": regex}},
    )  # fmt: skip
    choice = client.chat.completions.create(model=MODEL_NAME, **kwargs).choices[0]
    assert choice.message.content == "Checking."
    calls = check_calls(choice, names={"get_weather"})
    assert len(calls) == 2 and len({c.id for c in calls}) == 2
    content, streamed_calls, finish = streamed(client, **kwargs)
    assert (content, finish) == ("Checking.", "tool_calls")
    assert streamed_calls == [(c.function.name, c.function.arguments) for c in calls]
