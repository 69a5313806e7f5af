"""OpenAI's Responses API through `xlaserve serve` (the session's SmolLM2 server, hermes tool parser,
auto tool choice on) and the official `openai` client: answers equal to the chat route's for the
same conversation, the typed event stream in its documented order, function-call round trips,
json_schema formats, the store (previous_response_id, retrieve, delete, eviction) and the errors."""

from __future__ import annotations

import json
import re
import time

import httpx
import jsonschema
import openai
import pytest

from helpers.sdk_clients import strict_openai
from helpers.server_harness import MAX_STORED_RESPONSES, MODEL_NAME, metric, metrics, wait_for_metrics
from xlaserve.entrypoints.openai.responses_convert import input_turns, media_fields, to_chat_request
from xlaserve.entrypoints.openai.responses_protocol import ResponsesRequest
from xlaserve.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from xlaserve.entrypoints.openai.responses_stream import EventWriter, OutputStream
from xlaserve.entrypoints.openai.responses_turn import answer_turn
from xlaserve.entrypoints.serving.chat_parsing import ChoiceDelta
from xlaserve.entrypoints.serving.tool_parsers import DeltaFunctionCall, DeltaToolCall

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}
]
ASK = "What will the weather be in Paris for the next 3 days?"
QUESTION = "Name three colors."
INSTRUCTIONS = "Answer briefly."
GREEDY = {"temperature": 0.0, "max_output_tokens": 12}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return strict_openai(server)


def _create(client, **fields):
    return client.responses.create(model=MODEL_NAME, **{**GREEDY, **fields})


def _post(server, body: dict, path: str = "/v1/responses", method: str = "POST") -> httpx.Response:
    return httpx.request(method, server.url + path, json=body, headers=server.headers, timeout=300)


def _prompt_ids(server, messages: list[dict]) -> list[int]:
    response = httpx.post(server.url + "/tokenize", json={"messages": messages}, headers=server.headers)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def _chat(server, messages: list[dict], max_tokens: int) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    response = _post(server, body, "/v1/chat/completions")
    assert response.status_code == 200, response.text
    return response.json()


def test_greedy_text_and_usage_equal_the_chat_route(server, client):
    response = _create(client, instructions=INSTRUCTIONS, input=QUESTION)
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    chat = _chat(server, messages, GREEDY["max_output_tokens"])
    choice = chat["choices"][0]
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL_NAME
    assert response.service_tier == "auto"
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == choice["message"]["content"] and response.output_text
    assert response.usage.input_tokens == chat["usage"]["prompt_tokens"] == len(_prompt_ids(server, messages))
    assert response.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    is_cut = choice["finish_reason"] == "length"
    assert response.status == ("incomplete" if is_cut else "completed")
    # The same conversation as items (a developer message, input_text parts) is the same prompt.
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": INSTRUCTIONS}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Name three "},
                                     {"type": "input_text", "text": "colors."}]},
    ]  # fmt: skip
    as_items = _create(client, input=items, store=False)
    assert as_items.output_text == response.output_text
    assert as_items.usage.input_tokens == response.usage.input_tokens


def test_output_text_logprobs_are_the_chat_routes_and_stream_alike(server, client):
    """include message.output_text.logprobs: the message's tokens, each with its top_logprobs, equal the
    chat route's logprobs for the same greedy request; streamed, the deltas' logprobs join into the
    same list, and the done event and the final response hold it whole. Without `include`, none."""
    # The plain request first puts the prompt's blocks in the prefix cache, so every request compared
    # below runs the same steps (32 tokens cached, a 2-token tail in a 4-token bucket). The session
    # server is float32 without --batch-invariant-float32, where a dot of 64 rows sums K in another
    # order than one of 4 (README, "Batch invariance"): the prompt prefilled whole (34 tokens, the
    # 64-token bucket) gave the first token's logprob -2.164733, the cached prefix's tail -2.164713.
    plain = _create(client, input=QUESTION, store=False, top_logprobs=3)  # no include: no logprobs
    include = {"include": ["message.output_text.logprobs"], "top_logprobs": 3}
    response = _create(client, input=QUESTION, store=False, **include)
    chat = _post(
        server,
        {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": GREEDY["max_output_tokens"],
         "temperature": 0, "logprobs": True, "top_logprobs": 3},
        "/v1/chat/completions",
    ).json()  # fmt: skip
    assert chat["choices"][0]["finish_reason"] == "stop"  # the answer ends with the stop token...
    *expected, stop = chat["choices"][0]["logprobs"]["content"]
    assert stop["token"] == "<|im_end|>", stop  # ...which writes no answer text: not the message's
    (message,) = response.output
    logprobs = [entry.model_dump() for entry in message.content[0].logprobs]
    assert logprobs == expected and len(logprobs) == response.usage.output_tokens - 1 > 3
    assert "".join(entry["token"] for entry in logprobs) == response.output_text
    assert all(len(entry["top_logprobs"]) == 3 for entry in logprobs)
    assert response.top_logprobs == 3
    cached = response.usage.input_tokens_details.cached_tokens
    assert cached == chat["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    events = _events(server, {"model": MODEL_NAME, "input": QUESTION, **GREEDY, **include})
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [entry for e in deltas for entry in e["logprobs"]] == expected
    assert all(len(e["logprobs"]) >= 1 for e in deltas)
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    assert done["logprobs"] == expected
    assert events[-1]["response"]["output"][0]["content"][0]["logprobs"] == expected
    assert plain.output_text == response.output_text and plain.output[0].content[0].logprobs == []


def test_output_logprobs_skip_reasoning_calls_and_tokens_held_back():
    """What the parser does not write as answer text takes its tokens' logprobs with it; a token whose
    text is held back (part of a character, a tag not yet read) joins the answer text written later."""
    stream = OutputStream(EventWriter())
    entry = [{"token": f"t{i}", "logprob": -float(i), "bytes": [], "top_logprobs": []} for i in range(7)]
    events = stream.feed(ChoiceDelta(reasoning="hm"), [entry[0]])
    events += stream.feed(None, [entry[1]])  # "</think>": nothing written
    events += stream.feed(ChoiceDelta(content="Hi"), [entry[2]])
    events += stream.feed(None, [entry[3]])  # a held-back piece...
    events += stream.feed(ChoiceDelta(content=" there"), [entry[4]])  # ...let out with the next token
    call = DeltaToolCall(0, DeltaFunctionCall("get_weather", "{}"), id="call_1", type="function")
    events += stream.feed(ChoiceDelta(tool_calls=[call]), [entry[5], entry[6]])
    events += stream.finish("completed")
    payloads = [json.loads(e.split("data: ", 1)[1]) for e in events]
    deltas = [p["logprobs"] for p in payloads if p["type"] == "response.output_text.delta"]
    assert deltas == [[entry[2]], [entry[3], entry[4]]]
    message = next(item for item in stream.items if item.type == "message")
    assert message.content[0].logprobs == entry[2:5] and message.content[0].text == "Hi there"


def test_truncation_auto_keeps_the_prompts_last_tokens(client):
    """vLLM's truncation "auto" (truncate_prompt_tokens -1): a prompt past the context keeps its last
    tokens, room left for max_output_tokens; "disabled" (the default) refuses it."""
    fields = {"input": "Paris is lovely. " * 200, "max_output_tokens": 2, "store": False}
    cut = _create(client, **fields, truncation="auto")
    assert cut.truncation == "auto" and cut.usage.input_tokens == 512 - 2 and cut.usage.output_tokens == 2
    with pytest.raises(openai.BadRequestError) as refused:
        _create(client, **fields)
    assert refused.value.body["param"] in ("input", "max_output_tokens")


def test_max_output_tokens_makes_it_incomplete(client):
    response = _create(client, input=QUESTION, max_output_tokens=2, store=False, service_tier="flex")
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.service_tier == "flex"  # vLLM's five tiers, echoed (one tier here)
    assert response.usage.output_tokens == 2
    (message,) = response.output
    assert message.status == "incomplete" and message.content[0].type == "output_text"


def _events(server, body: dict) -> list[dict]:
    """Every event of a streamed response, checked for its `event:` line and its sequence_number."""
    events = []
    with httpx.stream(
        "POST",
        server.url + "/v1/responses",
        json={**body, "stream": True},
        headers=server.headers,
        timeout=300,
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: ") :])
                assert data["type"] == name and data["sequence_number"] == len(events)
                events.append(data)
    return events


def test_stream_event_order_and_deltas(server, client):
    body = {"model": MODEL_NAME, "input": QUESTION, "instructions": INSTRUCTIONS, **GREEDY}
    events = _events(server, body)
    kinds = [e["type"] for e in events]
    num_deltas = kinds.count("response.output_text.delta")
    assert num_deltas >= 1
    final = (
        "response.incomplete" if events[-1]["response"]["status"] == "incomplete" else "response.completed"
    )
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * num_deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        final,
    ]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    done = next(e for e in events if e["type"] == "response.output_text.done")
    response = events[-1]["response"]
    assert done["text"] == text == response["output"][0]["content"][0]["text"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["id"] == response["id"]
    assert events[2]["item"]["id"] == done["item_id"] == response["output"][0]["id"]
    # The streamed answer is the one-shot answer, and the stored one.
    assert text == _create(client, input=QUESTION, instructions=INSTRUCTIONS, store=False).output_text
    assert client.responses.retrieve(response["id"]).output_text == text
    # The openai client reads the same stream into its typed events.
    streamed = client.responses.create(
        model=MODEL_NAME, input=QUESTION, instructions=INSTRUCTIONS, stream=True, **GREEDY
    )
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == text


def _check_call(item) -> dict:
    assert item.type == "function_call" and item.name == "get_weather" and item.status == "completed"
    assert item.call_id and item.id.startswith("fc_")
    arguments = json.loads(item.arguments)
    jsonschema.validate(arguments, WEATHER)
    return arguments


def test_function_call_round_trip(server, client):
    first = _create(
        client,
        input=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
    )
    assert first.status == "completed" and [item.type for item in first.output] == ["function_call"]
    (call,) = first.output
    _check_call(call)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"forecast": "sunny"}'}
    # Continued by id: the call is in the stored history, so its output may answer it.
    by_id = _create(client, previous_response_id=first.id, input=[result], tools=TOOLS, tool_choice="none")
    assert [item.type for item in by_id.output] == ["message"] and by_id.output_text
    # The same turn sent whole, the previous output as items as the SDK dumps them (the newest SDK's
    # items carry `async`, `caller`, `namespace` and a message's `phase`, null): the same prompt and answer.
    items = [
        {"role": "user", "content": ASK},
        *[i.model_dump(mode="json", by_alias=True) for i in first.output],
        result,
    ]
    whole = _create(client, input=items, tools=TOOLS, tool_choice="none", store=False)
    assert whole.usage.input_tokens == by_id.usage.input_tokens
    assert whole.output_text == by_id.output_text


def test_named_function_streams_argument_events(server):
    body = {
        "model": MODEL_NAME, "input": ASK, "tools": TOOLS, "temperature": 0, "max_output_tokens": 40,
        "tool_choice": {"type": "function", "name": "get_weather"}, "store": False,
    }  # fmt: skip
    events = _events(server, body)
    kinds = [e["type"] for e in events]
    num_deltas = kinds.count("response.function_call_arguments.delta")
    assert num_deltas >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * num_deltas,
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    done = events[-3]
    assert done["arguments"] == arguments and done["name"] == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER)
    item = events[-1]["response"]["output"][0]
    assert item["arguments"] == arguments and item["call_id"] == events[2]["item"]["call_id"]


def test_forced_call_cut_by_max_output_tokens_is_calls_only_streamed_or_not(server, client):
    """A named tool_choice cut by max_output_tokens (the chat path's forced parser): a function_call item
    only, its arguments as far as they went, the same in the stream's final response. Stored, it is
    continued like any response, but its cut call is not in the history: answering it is a 400 that says
    so (vLLM answers a call id it never checks)."""
    choice = {"type": "function", "name": "get_weather"}
    fields = {"input": ASK, "tools": TOOLS, "tool_choice": choice}
    whole = _create(client, **fields, max_output_tokens=8)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    calls = [(item.type, item.name, item.arguments) for item in whole.output]
    assert len(calls) == 1 and calls[0][:2] == ("function_call", "get_weather"), whole.output
    body = {"model": MODEL_NAME, **fields, "temperature": 0, "max_output_tokens": 8, "store": False}
    final = _events(server, body)[-1]
    assert final["type"] == "response.incomplete"
    assert [(i["type"], i["name"], i["arguments"]) for i in final["response"]["output"]] == calls
    answer = [{"type": "function_call_output", "call_id": whole.output[0].call_id, "output": "sunny"}]
    with pytest.raises(openai.BadRequestError) as refused:
        _create(client, previous_response_id=whole.id, input=answer, tools=TOOLS, store=False)
    assert refused.value.body["param"] == "input[0].call_id"
    assert "cut by max_output_tokens" in refused.value.body["message"]
    again = _create(client, previous_response_id=whole.id, input="Go on.", max_output_tokens=1, store=False)
    assert again.previous_response_id == whole.id and again.usage.output_tokens == 1


def test_json_schema_format_validates(client):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
            "population_millions": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "population_millions"],
        "additionalProperties": False,
    }
    text = {"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}}
    response = _create(client, input="Describe Paris as JSON.", text=text, max_output_tokens=60, store=False)
    assert response.status == "completed", response.output_text
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema" and response.text.format.name == "city"


def test_previous_response_id_carries_the_history(server, client):
    first = _create(client, input="My name is Ada.", instructions=INSTRUCTIONS, max_output_tokens=6)
    second = _create(client, input="What is my name?", previous_response_id=first.id, max_output_tokens=4)
    # The instructions are not carried over, the first answer is.
    history = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    assert second.usage.input_tokens == len(_prompt_ids(server, history))
    alone = _prompt_ids(server, history[-1:])
    assert second.usage.input_tokens > len(alone)
    assert second.previous_response_id == first.id
    third = _create(client, input="And again?", previous_response_id=second.id, max_output_tokens=2)
    history += [
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "And again?"},
    ]
    assert third.usage.input_tokens == len(_prompt_ids(server, history))


def _logged(server, pattern: str) -> bool:
    """Whether the server's log shows `pattern` within a few seconds (its lines arrive as written)."""
    deadline = time.monotonic() + 10
    while True:
        with open(server.log_path, errors="replace") as f:
            if re.search(pattern, f.read()):
                return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def test_request_id_names_the_engine_request_and_comes_back_as_x_request_id(server, client):
    """vLLM's body request_id names the engine's request (its log line) and comes back as the answer's
    X-Request-Id header; the response's id stays the store's own resp_ id. An X-Request-Id header wins
    over the body's, as on the chat route, streamed or not."""
    body = {"input": QUESTION, "max_output_tokens": 1, "store": False}
    answer = _post(server, {**body, "request_id": "trace-7"})
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-request-id"] == "trace-7"
    assert re.fullmatch(r"resp_[0-9a-f]{32}", answer.json()["id"])
    streamed = httpx.post(
        server.url + "/v1/responses",
        json={**body, "stream": True, "request_id": "from-the-body"},
        headers={**server.headers, "X-Request-Id": "header-8"},
        timeout=300,
    )
    assert streamed.status_code == 200 and streamed.headers["x-request-id"] == "header-8"
    assert "event: response.incomplete" in streamed.text  # max_output_tokens: 1
    raw = client.responses.with_raw_response.create(
        model=MODEL_NAME, input=QUESTION, max_output_tokens=1, store=False, extra_body={"request_id": "sdk-9"}
    )
    assert raw.headers["x-request-id"] == "sdk-9" and raw.parse().id.startswith("resp_")
    for sent in ("trace-7", "header-8", "sdk-9"):  # after `resp-`, with 8 random hex digits, as chat's
        assert _logged(server, rf"request resp-{sent}-[0-9a-f]{{8}}: "), sent
    with open(server.log_path, errors="replace") as f:
        assert "resp-from-the-body" not in f.read()  # its request logged header-8 by now
    # None sent: no header (this server runs without --enable-request-id-headers); the engine's id is
    # the response's own.
    plain = _post(server, body)
    assert plain.status_code == 200 and "x-request-id" not in plain.headers
    assert _logged(server, rf"request {plain.json()['id']}: ")


def test_video_parts_and_chat_template_kwargs_reach_the_chat_request():
    """A user message's video_url part (chat's) is the chat request's, in place, named by its Responses
    field (an earlier turn's by previous_response_id); chat_template_kwargs pass on as sent."""
    content = [
        {"type": "input_text", "text": "a"},
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AA"}},
        {"type": "input_image", "image_url": "data:image/png;base64,AA"},
    ]
    kwargs = {"enable_thinking": False}
    req = ResponsesRequest.model_validate(
        {"input": [{"role": "user", "content": content}], "chat_template_kwargs": kwargs}
    )
    history = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "data:,old"}}]}]
    assert media_fields(req, history) == {
        "image_url": ["input[0].content[2].image_url"],
        "video_url": ["previous_response_id", "input[0].content[1].video_url"],
    }
    chat = to_chat_request(req, history + input_turns(req, history))
    assert [part.type for part in chat.messages[1].content] == ["text", "video_url", "image_url"]
    assert chat.messages[1].content[1].video_url.url == "data:video/mp4;base64,AA"
    assert chat.chat_template_kwargs == kwargs


def test_retrieve_delete_and_not_stored(server, client):
    response = _create(client, input=QUESTION, max_output_tokens=2, metadata={"run": "7"})
    again = client.responses.retrieve(response.id)
    assert again.id == response.id and again.output_text == response.output_text
    assert again.usage == response.usage and again.metadata == {"run": "7"}
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    for method in ("GET", "DELETE"):
        raw = httpx.request(method, f"{server.url}/v1/responses/{response.id}", headers=server.headers)
        assert raw.status_code == 404
        error = raw.json()["error"]
        assert error["type"] == "not_found_error" and error["code"] == "response_not_found"
        assert response.id in error["message"]
    unstored = _create(client, input=QUESTION, max_output_tokens=1, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    raw = _post(server, {"input": "Hi", "previous_response_id": unstored.id})
    assert raw.status_code == 404 and raw.json()["error"]["param"] == "previous_response_id"


def test_store_evicts_the_least_recently_used(server, client):
    """The session server keeps MAX_STORED_RESPONSES: one more evicts the oldest not read since."""
    oldest = _create(client, input="Hi", max_output_tokens=1)
    kept = _create(client, input="Hi", max_output_tokens=1)
    for _ in range(MAX_STORED_RESPONSES - 2):
        _create(client, input="Hi", max_output_tokens=1)
    client.responses.retrieve(oldest.id)  # a read is a use: `kept` is now the least recently used
    _create(client, input="Hi", max_output_tokens=1)
    assert client.responses.retrieve(oldest.id).id == oldest.id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


def test_sdk_output_fields_sent_back_change_nothing():
    """The fields the newest SDK's output items carry (a message's `phase`, a call's `async`, `caller`
    and `namespace`, an output's `name`), as a client sends its items back: accepted, the same turns;
    wrong types are 400s naming them."""
    bare = [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    sent = [
        {**bare[0], "phase": "commentary"},
        {**bare[1], "async": False, "caller": {"type": "direct"}, "namespace": None},
        {**bare[2], "caller": {"type": "program", "caller_id": "ci_1"}, "name": "get_weather"},
    ]
    turns = [
        input_turns(ResponsesRequest(input=[{"role": "user", "content": ASK}, *items]), [])
        for items in (bare, sent)
    ]
    assert turns[0] == turns[1] and [t["role"] for t in turns[0]] == ["user", "assistant", "tool"]
    for item, field in [
        ({**bare[1], "async": "no"}, "async"),
        ({**bare[1], "caller": {"type": "x"}}, "caller.type"),
    ]:
        with pytest.raises(ValueError, match=re.escape(field)):
            ResponsesRequest(input=[item])


def test_store_unit():
    store = ResponseStore(2)
    for name in "abc":
        store.put(name, StoredResponse({"id": name}, []))
    assert store.get("a") is None and len(store) == 2
    store.get("b")
    store.put("d", StoredResponse({"id": "d"}, []))
    assert store.get("c") is None and store.get("b") is not None
    assert store.delete("b") and not store.delete("b")
    off = ResponseStore(0)
    off.put("a", StoredResponse({}, []))
    assert off.get("a") is None
    with pytest.raises(ValueError, match="max-stored-responses"):
        ResponseStore(-1)


ERROR_CASES = [  # (body over {"input": QUESTION}, status, param, words the message holds)
    ({"max_output_tokens": 10_000}, 400, "max_output_tokens", "512"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice.name", "nope"),
    ({"tool_choice": "required"}, 400, "tool_choice", "tools"),
    ({"input": [{"type": "image", "url": "x"}]}, 400, "input[0].type", "function_call"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input[0].content[0].image_url", "text only"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]}, 400,
     "input[0].content[0].type", "input_text"),
    ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]}, 400,
     "input[0].call_id", "call_9"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, 400,
     "input[0].arguments", "JSON object"),
    ({"input": []}, 400, "input", "empty"),
    ({"previous_response_id": "resp_nothing"}, 404, "previous_response_id", "resp_nothing"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "foo"}}}}, 400,
     "text.format.schema", "text.format.schema"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "foo"}}], "tool_choice": "required"},
     400, "tools[0].parameters", "tools[0].parameters"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type", "function"),
    ({"truncation": "middle"}, 400, "truncation", "disabled"),
    ({"background": True}, 400, "store", "store: true"),
    ({"top_logprobs": 21}, 400, "top_logprobs", "20"),
    ({"include": ["file_search_call.result"]}, 400, "include[0]", "message.output_text.logprobs"),
    ({"model": "gpt-5"}, 404, "model", "gpt-5"),
]  # fmt: skip


def test_a_background_response_is_polled_to_the_answer_and_a_cancelled_one_stops(server, client):
    foreground = client.responses.create(input=QUESTION, **GREEDY, store=False)
    queued = client.responses.create(input=QUESTION, **GREEDY, background=True)
    assert queued.status == "queued" and queued.background and queued.output == []
    done = _poll(client, queued.id)
    # The same answer as in the foreground (greedy, batch invariant), ids aside.
    assert done.status == "completed" and done.background
    assert [i.model_dump(exclude={"id"}) for i in done.output] == [
        i.model_dump(exclude={"id"}) for i in foreground.output
    ]
    assert done.usage.output_tokens == foreground.usage.output_tokens
    # Streamed as it is made, and followed again later from any event on.
    with client.responses.create(input=QUESTION, **GREEDY, background=True, stream=True) as stream:
        events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:3]] == ["response.queued", "response.created", "response.in_progress"]
    assert events[-1].type == "response.completed" and events[-1].response.background
    assert [i.model_dump(exclude={"id"}) for i in events[-1].response.output] == [
        i.model_dump(exclude={"id"}) for i in foreground.output
    ]
    again = list(client.responses.retrieve(events[0].response.id, stream=True, starting_after=2))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in events[3:]]
    # Cancelled while it runs: its request aborted, its blocks freed, the response `cancelled`.
    before = metrics(server)
    long = client.responses.create(
        input="Tell me a long story about the sea.",
        temperature=0.0,
        max_output_tokens=300,
        background=True,
        extra_body={"ignore_eos": True},
    )
    wait_for_metrics(
        server, lambda m: metric(m, "num_requests_running") == 1, "the background response running"
    )
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(long.id).status == "cancelled"
    idle = wait_for_metrics(server, lambda m: metric(m, "num_requests_running") == 0, "the response aborted")
    assert metric(idle, "kv_cache_usage_perc") == 0
    assert metric(idle, "generation_tokens_total") - metric(before, "generation_tokens_total") < 300
    assert client.responses.cancel(done.id).status == "completed"  # finished: returned as it is
    # Only background responses cancel; a cancelled one has no answer to continue.
    stored = client.responses.create(input=QUESTION, **GREEDY)
    # Only a background response's events are kept.
    for response, param in [
        (httpx.post(f"{server.url}/v1/responses/{stored.id}/cancel", headers=server.headers), "response_id"),
        (_post(server, {"input": QUESTION, "previous_response_id": long.id}), "previous_response_id"),
        (httpx.get(f"{server.url}/v1/responses/{stored.id}?stream=true", headers=server.headers), "stream"),
    ]:
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param


def _poll(client, response_id: str):
    deadline = time.monotonic() + 120
    while True:
        response = client.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return response
        time.sleep(0.1)


@pytest.mark.parametrize("fields, status, param, words", ERROR_CASES, ids=[c[2] for c in ERROR_CASES])
def test_errors_name_the_field(server, fields, status, param, words):
    response = _post(server, {"input": QUESTION, "max_output_tokens": 1, "store": False, **fields})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert words in error["message"], error


def test_reasoning_then_text_then_call_stream_as_items():
    """What a --reasoning-parser gives (the session server has none): thinking, then the answer, then a
    call, each its own item, in order, and the whole answer's items in the same order."""
    write = EventWriter()
    stream = OutputStream(write)
    call = DeltaToolCall(0, DeltaFunctionCall("get_weather", '{"city": '), id="call_1", type="function")
    events = [
        *stream.feed(ChoiceDelta(reasoning="Let me ")),
        *stream.feed(ChoiceDelta(reasoning="think.", content="Sure.")),
        *stream.feed(ChoiceDelta(tool_calls=[call])),
        *stream.feed(ChoiceDelta(tool_calls=[DeltaToolCall(0, DeltaFunctionCall(None, '"Paris"}'))])),
        *stream.finish("completed"),
    ]
    payloads = [json.loads(event.split("data: ", 1)[1]) for event in events]
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    assert [p["type"] for p in payloads] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert [p["output_index"] for p in payloads if p["type"] == "response.output_item.done"] == [0, 1, 2]
    reasoning, message, function_call = (item.model_dump() for item in stream.items)
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [
        {"type": "reasoning_text", "text": "Let me think."}
    ]
    assert message["content"][0]["text"] == "Sure." and message["status"] == "completed"
    assert function_call["arguments"] == '{"city": "Paris"}' and function_call["call_id"] == "call_1"
    turn = answer_turn(stream.items)
    assert (
        turn["content"] == "Sure." and turn["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    )
