"""Anthropic's Messages API through `xlaserve serve` (the session's SmolLM2 server) and the official
`anthropic` client (2.16: sampling fields go in extra_body): results, usage against count_tokens and
/tokenize, stop reasons, the event stream in its documented order and the client's own stream helpers,
max_tokens 0 pre-warming the prefix cache (usage's cache_read_input_tokens), the fields accepted and
ignored, the API key in either header, output_config's structured output, thinking on a server without a
reasoning parser, and forced tool choices answered with tool_use blocks only, streamed or not."""

from __future__ import annotations

import json
import uuid
from types import SimpleNamespace

import anthropic
import httpx
import jsonschema
import pytest
from pydantic import BaseModel

from helpers.sdk_clients import anthropic_prompt_tokens, strict_anthropic
from helpers.server_harness import MODEL_NAME
from xlaserve.entrypoints.anthropic.protocol import Usage

QUESTION = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return strict_anthropic(server)


GREEDY = {"temperature": 0}  # this client has no temperature argument; the API still takes the field
BLOCK_SIZE = 16  # the server's KV block: a prefix-cache hit is whole blocks
# What the prefix cache held of a prompt differs from run to run (a second run finds the first's blocks),
# and with it the tokens computed: left out where a stream and a message are compared, with the id.
UNCACHED = {"input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"}
NOT_COMPARED = {"id": True, "usage": UNCACHED}


def _create(client, **fields):
    return client.messages.create(model=MODEL_NAME, extra_body=GREEDY, **{"max_tokens": 8, **fields})


def _prompt_ids(server, messages: list[dict]) -> list[int]:
    """The engine's own count: /tokenize on the same conversation through the same template."""
    response = httpx.post(server.url + "/tokenize", json={"messages": messages}, headers=server.headers)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def test_round_trip_usage_and_count_tokens(server, client):
    message = _create(client, messages=QUESTION, system="Answer briefly.")
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL_NAME
    assert message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"] and message.content[0].text
    counted = client.messages.count_tokens(model=MODEL_NAME, messages=QUESTION, system="Answer briefly.")
    engine_ids = _prompt_ids(server, [{"role": "system", "content": "Answer briefly."}, *QUESTION])
    assert anthropic_prompt_tokens(message.usage) == counted.input_tokens == len(engine_ids)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 8


def test_system_as_blocks_equals_system_as_string(client):
    as_string = client.messages.count_tokens(model=MODEL_NAME, messages=QUESTION, system="Be terse.")
    blocks = [
        {"type": "text", "text": "Be "},
        {"type": "text", "text": "terse.", "cache_control": {"type": "ephemeral"}},
    ]
    as_blocks = client.messages.count_tokens(model=MODEL_NAME, messages=QUESTION, system=blocks)
    assert as_blocks.input_tokens == as_string.input_tokens


def test_end_turn_and_stop_sequence(client):
    free = _create(client, messages=QUESTION, max_tokens=64)
    assert free.stop_reason == "end_turn" and free.stop_sequence is None, free
    text = free.content[0].text
    assert free.usage.output_tokens < 64
    # A word from the middle of the greedy answer: the same request stops right before it.
    words = text.split()
    assert len(words) >= 3, text
    stop = words[len(words) // 2]
    stopped = _create(client, messages=QUESTION, max_tokens=64, stop_sequences=["\u2603", stop])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == text[: text.index(stop)]


def test_the_one_shot_reply_leaves_a_null_stop_sequence_out(server):
    """vLLM's reply is its model_dump(exclude_none=True): no stop string matched, no stop_sequence key
    (the SDKs read it as None; a matched one is there: test_end_turn_and_stop_sequence)."""
    response = httpx.post(
        server.url + "/v1/messages",
        json={"model": MODEL_NAME, "max_tokens": 3, "temperature": 0, "messages": QUESTION},
        headers=server.headers,
        timeout=300,
    )
    assert response.status_code == 200, response.text
    reply = response.json()
    assert reply["stop_reason"] == "max_tokens" and "stop_sequence" not in reply, reply


def test_prefill_continues_the_final_assistant_message(server, client):
    """A final assistant message is continued, as the chat route's continue_final_message does."""
    conversation = [*QUESTION, {"role": "assistant", "content": "The three colors are"}]
    message = _create(client, messages=conversation)
    response = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": conversation, "max_tokens": 8, "temperature": 0,
              "add_generation_prompt": False, "continue_final_message": True},
        headers=server.headers,
        timeout=300,
    )  # fmt: skip
    chat = response.json()
    assert message.content[0].text == chat["choices"][0]["message"]["content"]
    assert anthropic_prompt_tokens(message.usage) == chat["usage"]["prompt_tokens"]


def read_events(server, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event, as sent."""
    events = []
    with httpx.stream(
        "POST",
        server.url + "/v1/messages",
        json={**body, "stream": True},
        headers=server.headers,
        timeout=300,
    ) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith(
            "text/event-stream"
        )
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: ") :])
                assert data["type"] == name
                events.append((name, data))
    return events


def test_stream_events_in_documented_order(server):
    body = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0, "messages": QUESTION}
    events = read_events(server, body)
    names = [name for name, _ in events if name != "ping"]
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    deltas = [data for name, data in events if name == "content_block_delta"]
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for d in deltas)
    final = events[-2][1]
    assert final["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    usage = final["usage"]
    # vLLM's buckets, in message_start too (sent once the engine answered): what earlier requests left
    # in the cache, the prompt's other whole blocks (written to it), and its last partial block.
    num_cached, num_created = usage["cache_read_input_tokens"], usage["cache_creation_input_tokens"]
    assert start["usage"] == usage | {"output_tokens": 0} and usage["output_tokens"] == 8
    num_prompt = len(_prompt_ids(server, QUESTION))
    assert num_cached + num_created == num_prompt // BLOCK_SIZE * BLOCK_SIZE
    assert usage["input_tokens"] == num_prompt % BLOCK_SIZE and num_cached % BLOCK_SIZE == 0


def test_stream_helper_equals_the_message(client):
    """The client's own accumulator parses the events into the message the non-streaming call returns."""
    for fields in ({"max_tokens": 8}, {"max_tokens": 64}, {"max_tokens": 64, "stop_sequences": ["Green"]}):
        with client.messages.stream(
            model=MODEL_NAME, extra_body=GREEDY, messages=QUESTION, **fields
        ) as stream:
            texts = list(stream.text_stream)
            streamed = stream.get_final_message()
        whole = _create(client, messages=QUESTION, **fields)
        assert "".join(texts) == whole.content[0].text
        assert streamed.model_dump(exclude=NOT_COMPARED) == whole.model_dump(exclude=NOT_COMPARED)


def _fresh_system() -> str:
    """A system prompt no earlier request sent: its prompt's first block is in no cache."""
    return f"Session {uuid.uuid4().hex}. Answer briefly."


def _prewarmed_hit(num_prompt_tokens: int) -> int:
    """What a prompt run before finds in the prefix cache: its whole blocks, short of its last token
    (which is computed again to sample from)."""
    return (num_prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_max_tokens_0_prewarms_the_prefix_cache(client):
    """max_tokens 0 (Anthropic's cache pre-warming): the prompt runs through the engine and nothing is
    answered: no content, stop reason max_tokens, no output token; the same prompt then reads its blocks
    from the prefix cache, unless salted otherwise."""
    fields = {"messages": QUESTION, "system": _fresh_system()}
    warm = client.messages.create(model=MODEL_NAME, max_tokens=0, **fields)
    num_prompt = client.messages.count_tokens(model=MODEL_NAME, **fields).input_tokens
    assert warm.content == [] and (warm.stop_reason, warm.stop_sequence) == ("max_tokens", None)
    whole_blocks = num_prompt // BLOCK_SIZE * BLOCK_SIZE  # what the prompt writes to the cache
    assert warm.usage.model_dump(exclude_none=True) == {
        "input_tokens": num_prompt - whole_blocks,
        "output_tokens": 0,
        "cache_creation_input_tokens": whole_blocks,
        "cache_read_input_tokens": 0,
    }
    answer = _create(client, max_tokens=4, **fields)
    assert answer.usage.cache_read_input_tokens == _prewarmed_hit(num_prompt) > 0
    assert answer.usage.cache_creation_input_tokens == whole_blocks - _prewarmed_hit(num_prompt)
    assert answer.usage.input_tokens == num_prompt - whole_blocks and answer.content[0].text
    assert answer.usage.service_tier is None  # vLLM reports none
    # vLLM's cache_salt (extra_body): a salted request shares no blocks with the unsalted ones.
    salted = client.messages.create(model=MODEL_NAME, max_tokens=1, extra_body={"cache_salt": "b"}, **fields)
    assert salted.usage.cache_read_input_tokens == 0
    assert salted.usage.cache_creation_input_tokens == whole_blocks


def test_usage_has_the_cache_buckets_with_prompt_tokens_details_only():
    """As vLLM's: without --enable-prompt-tokens-details the cache's buckets are left out (not null, not
    0) and input_tokens is the whole prompt; with it, the prompt splits into the three."""
    counts = SimpleNamespace(num_cached_tokens=32, num_cache_creation_tokens=16)
    assert Usage.of(50, 3, counts, False).model_dump() == {"input_tokens": 50, "output_tokens": 3}
    assert Usage.of(50, 3, counts, True).model_dump() == {
        "input_tokens": 2,
        "output_tokens": 3,
        "cache_creation_input_tokens": 16,
        "cache_read_input_tokens": 32,
    }


def test_max_tokens_0_streamed_is_the_stop_alone(server, client):
    """Streamed, pre-warming sends no block: message_start, ping, message_delta (max_tokens, no output
    token), message_stop; the SDK's accumulated message is empty, and the prompt is cached all the same."""
    fields = {"messages": QUESTION, "system": _fresh_system()}
    events = read_events(server, {"model": MODEL_NAME, "max_tokens": 0, **fields})
    assert [name for name, _ in events] == ["message_start", "ping", "message_delta", "message_stop"]
    usage = events[0][1]["message"]["usage"]
    num_prompt = anthropic_prompt_tokens(usage)
    assert usage["cache_read_input_tokens"] == 0 and usage["cache_creation_input_tokens"] > 0
    assert events[2][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
        "usage": usage,
    }
    with client.messages.stream(model=MODEL_NAME, max_tokens=0, **fields) as stream:
        warmed = stream.get_final_message()
    assert warmed.content == [] and warmed.stop_reason == "max_tokens" and warmed.usage.output_tokens == 0
    assert warmed.usage.cache_read_input_tokens == _prewarmed_hit(num_prompt) > 0


def test_fields_accepted_and_ignored_change_nothing(client):
    """service_tier, inference_geo, speed and the top-level cache_control (Anthropic's automatic
    caching: here prefix caching always is) are accepted and leave the answer as it was."""
    plain = _create(client, messages=QUESTION)
    ignored = {"service_tier": "standard_only", "inference_geo": "us", "speed": "fast"}
    message = _create(client, messages=QUESTION, cache_control={"type": "ephemeral", "ttl": "1h"}, **ignored)
    assert message.model_dump(exclude=NOT_COMPARED) == plain.model_dump(exclude=NOT_COMPARED)
    counted = client.messages.count_tokens(
        model=MODEL_NAME, messages=QUESTION, speed="standard", cache_control={"type": "ephemeral"}
    )
    assert counted.input_tokens == anthropic_prompt_tokens(plain.usage)


def test_api_key_in_either_header(server):
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=server.api_key, max_retries=0, timeout=300)
    assert bearer.messages.count_tokens(model=MODEL_NAME, messages=QUESTION).input_tokens > 0
    wrong = anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0, timeout=300)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model=MODEL_NAME, max_tokens=1, messages=QUESTION)
    assert caught.value.status_code == 401
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": caught.value.body["error"]["message"]},
    }
    response = httpx.post(
        server.url + "/v1/messages/count_tokens", json={"model": MODEL_NAME, "messages": QUESTION}
    )
    assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"


def test_unknown_model_is_404_not_found_error(client):
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="claude-nothing", max_tokens=1, messages=QUESTION)
    assert caught.value.body["error"]["type"] == "not_found_error"


def test_models_list_and_retrieve_in_each_sdks_shape(server, client):
    """One /v1/models for both SDKs: Anthropic's (its anthropic-version header) reads its ModelInfo page,
    strictly validated; OpenAI's still reads vLLM's cards; an unknown model is each one's 404."""
    (info,) = client.models.list().data
    assert (info.type, info.id, info.display_name, info.lifecycle) == (
        "model",
        MODEL_NAME,
        MODEL_NAME,
        "active",
    )
    assert info.max_input_tokens == info.max_tokens == 511  # the session server's context, less one
    assert client.models.retrieve(MODEL_NAME) == info
    page = httpx.get(server.url + "/v1/models", headers={**server.headers, "anthropic-version": "2023-06-01"})
    assert (
        page.json()["has_more"] is False and page.json()["first_id"] == page.json()["last_id"] == MODEL_NAME
    )
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.models.retrieve("claude-nothing")
    assert caught.value.body["error"]["type"] == "not_found_error" and "claude-nothing" in str(
        caught.value.body
    )
    openai_shape = httpx.get(server.url + "/v1/models/" + MODEL_NAME, headers=server.headers).json()
    assert openai_shape["object"] == "model" and openai_shape["max_model_len"] == 512
    refused = httpx.get(server.url + "/v1/models", headers={"anthropic-version": "2023-06-01"})
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    assert refused.json()["type"] == "error"


# -- tools ---------------------------------------------------------------------------------------------

WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,  # else SmolLM2 goes on adding properties past max_tokens
    },
}
TIME = {
    "name": "get_time",
    "description": "Get the local time in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]
FORCE_WEATHER = {"type": "tool", "name": "get_weather"}
SCHEMAS = {tool["name"]: tool["input_schema"] for tool in (WEATHER, TIME)}


def _check_calls(message, max_calls: int | None = None) -> list:
    calls = [block for block in message.content if block.type == "tool_use"]
    assert calls and message.stop_reason == "tool_use", message
    assert max_calls is None or len(calls) <= max_calls
    for call in calls:
        jsonschema.validate(call.input, SCHEMAS[call.name])
    assert len({call.id for call in calls}) == len(calls)
    return calls


def test_tool_choice_tool_returns_a_valid_call(client):
    choice = {"type": "tool", "name": "get_time"}
    message = _create(client, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=48)
    (call,) = _check_calls(message)
    assert call.name == "get_time"


@pytest.mark.parametrize("disable_parallel", [False, True])
def test_tool_choice_any_returns_valid_calls(client, disable_parallel):
    choice = {"type": "any", "disable_parallel_tool_use": disable_parallel}
    message = _create(client, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=96)
    _check_calls(message, max_calls=1 if disable_parallel else None)


def test_tool_round_trip_completes(server, client):
    """The call, its result, then the answer: the result reaches the prompt, and the turn ends in text."""
    first = _create(client, messages=ASK, tools=[WEATHER], tool_choice=FORCE_WEATHER, max_tokens=48)
    (call,) = _check_calls(first)
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "22 degrees, sunny"}
    history = [
        *ASK,
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": [result]},
    ]
    final = _create(client, messages=history, tools=[WEATHER], tool_choice={"type": "none"}, max_tokens=24)
    assert final.stop_reason in ("end_turn", "max_tokens") and [b.type for b in final.content] == ["text"]
    counted = client.messages.count_tokens(model=MODEL_NAME, messages=history, tools=[WEATHER])
    assert anthropic_prompt_tokens(final.usage) == counted.input_tokens > anthropic_prompt_tokens(first.usage)
    # The result is in the prompt the engine saw: the same conversation without it counts fewer tokens.
    without = [*history[:2], {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id}]}]
    fewer = client.messages.count_tokens(model=MODEL_NAME, messages=without, tools=[WEATHER])
    assert fewer.input_tokens < counted.input_tokens


def test_streamed_tool_call_equals_the_message(server, client):
    fields = {"messages": ASK, "tools": [WEATHER], "tool_choice": FORCE_WEATHER, "max_tokens": 48}
    with client.messages.stream(model=MODEL_NAME, extra_body=GREEDY, **fields) as stream:
        streamed = stream.get_final_message()
    whole = _create(client, **fields)
    (streamed_call,), (call,) = _check_calls(streamed), _check_calls(whole)
    assert (streamed_call.name, streamed_call.input) == (call.name, call.input)
    assert streamed.usage.model_dump(exclude=UNCACHED) == whole.usage.model_dump(exclude=UNCACHED)
    events = read_events(server, {"model": MODEL_NAME, "temperature": 0, **fields})
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert deltas and all(d["type"] == "input_json_delta" for d in deltas)
    assert json.loads("".join(d["partial_json"] for d in deltas)) == call.input


def test_auto_tool_choice_stream_and_message_agree(client):
    """tool_choice auto (the default with tools on this server): the model's own hermes-format text is
    read by the chat path's parser, the stream's blocks are the message's, and with tool_choice none the
    same text comes back unread."""
    fields = {"messages": ASK, "tools": [WEATHER], "max_tokens": 32}
    whole = _create(client, **fields)
    with client.messages.stream(model=MODEL_NAME, extra_body=GREEDY, **fields) as stream:
        streamed = stream.get_final_message()

    def blocks(message) -> list[dict]:
        return [block.model_dump(exclude={"id"}, exclude_none=True) for block in message.content]

    assert blocks(streamed) == blocks(whole) and whole.content
    assert streamed.model_dump(exclude={**NOT_COMPARED, "content": True}) == whole.model_dump(
        exclude={**NOT_COMPARED, "content": True}
    )
    unread = _create(client, **fields, tool_choice={"type": "none"})
    if any(block.type == "tool_use" for block in whole.content):
        assert whole.stop_reason == "tool_use" and "<tool_call>" in unread.content[0].text
    else:
        assert blocks(unread) == blocks(whole)


@pytest.mark.parametrize("max_tokens", [20, 40])
def test_forced_any_cut_by_max_tokens_is_tool_use_blocks_streamed_or_not(client, max_tokens):
    """tool_choice any whose call list max_tokens cuts: tool_use blocks only (never a text block of the
    call's raw JSON before them), stop reason max_tokens, and the stream's accumulated message (the
    SDK's partial parse of each input) is the message."""
    choice = {"type": "any"}
    fields = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": choice, "max_tokens": max_tokens}
    whole = _create(client, **fields)
    assert whole.content and all(block.type == "tool_use" for block in whole.content), whole
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == max_tokens
    with client.messages.stream(model=MODEL_NAME, extra_body=GREEDY, **fields) as stream:
        streamed = stream.get_final_message()
    assert streamed.model_dump(exclude={**NOT_COMPARED, "content": True}) == whole.model_dump(
        exclude={**NOT_COMPARED, "content": True}
    )
    assert [b.model_dump(exclude={"id"}) for b in streamed.content] == [
        b.model_dump(exclude={"id"}) for b in whole.content
    ]


# -- output_config.format (structured output) and thinking ---------------------------------------------

COLORS = {
    "type": "object",
    "properties": {
        "colors": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "minItems": 3,
            "maxItems": 3,
        },
    },
    "required": ["colors"],
    "additionalProperties": False,
}
COLORS_FORMAT = {"format": {"type": "json_schema", "schema": COLORS}}


def test_output_config_format_answers_schema_valid_json(client):
    message = _create(client, messages=QUESTION, max_tokens=96, output_config=COLORS_FORMAT)
    assert [block.type for block in message.content] == ["text"] and message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), COLORS)
    with client.messages.stream(
        model=MODEL_NAME, extra_body=GREEDY, messages=QUESTION, max_tokens=96, output_config=COLORS_FORMAT
    ) as stream:
        streamed = stream.get_final_message()
    assert streamed.model_dump(exclude=NOT_COMPARED) == message.model_dump(exclude=NOT_COMPARED)
    # The format constrains the answer, not the prompt.
    counted = client.messages.count_tokens(model=MODEL_NAME, messages=QUESTION, output_config=COLORS_FORMAT)
    assert counted.input_tokens == anthropic_prompt_tokens(message.usage)


class Capital(BaseModel):
    city: str
    country: str


def test_sdk_parse_with_a_pydantic_output_format(client):
    """messages.parse(output_format=Model): the SDK sends the model's schema as output_config.format and
    parses the answer back into the model."""
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    message = client.messages.parse(
        model=MODEL_NAME, extra_body=GREEDY, max_tokens=48, messages=ask, output_format=Capital
    )
    assert message.stop_reason == "end_turn", message
    assert isinstance(message.parsed_output, Capital) and message.parsed_output.city


def test_thinking_on_a_server_without_reasoning_parser_is_the_plain_answer(client):
    """This server has no --reasoning-parser: thinking enabled is accepted, and the answer is what the
    request without it gets (no thinking block; SmolLM2's template has no enable_thinking)."""
    plain = _create(client, messages=QUESTION, max_tokens=16)
    thinking = {"type": "enabled", "budget_tokens": 1024}
    message = _create(client, messages=QUESTION, max_tokens=16, thinking=thinking)
    assert [block.type for block in message.content] == ["text"]
    assert message.model_dump(exclude=NOT_COMPARED) == plain.model_dump(exclude=NOT_COMPARED)
    with client.messages.stream(
        model=MODEL_NAME, extra_body=GREEDY, messages=QUESTION, max_tokens=16, thinking={"type": "adaptive"}
    ) as stream:
        streamed = stream.get_final_message()
    assert streamed.model_dump(exclude=NOT_COMPARED) == plain.model_dump(exclude=NOT_COMPARED)
