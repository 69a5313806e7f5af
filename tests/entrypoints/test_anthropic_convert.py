"""The Messages API's host-side pieces without a server: a request as the chat template's conversation
(tool_use as tool_calls, tool_result as tool messages, prefill), the checks the schema cannot make,
pieces joined into blocks, stop reasons, and the stream's events for a scripted sequence of pieces."""

from __future__ import annotations

import json

import pytest

from xlaserve.entrypoints.anthropic.convert import to_chat
from xlaserve.entrypoints.anthropic.output import Piece, blocks_of, stop_reason
from xlaserve.entrypoints.anthropic.protocol import MessagesRequest
from xlaserve.entrypoints.anthropic.streaming import _Blocks
from xlaserve.entrypoints.openai.errors import OpenAIError
from xlaserve.outputs import CompletionOutput

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def request(messages, **fields) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": messages, **fields})


def test_tool_round_trip_becomes_tool_calls_and_tool_messages():
    req = request(
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Use the tool.", "signature": ""},
                    {"type": "text", "text": "Let me check."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                    {"type": "text", "text": "Thanks!"},
                ],
            },
        ],
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        tools=[WEATHER],
    )
    prompt = to_chat(req)
    call = {
        "id": "toolu_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }
    assert prompt.conversation == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "reasoning_content": "Use the tool.",
            "tool_calls": [call],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
        {"role": "user", "content": "Thanks!"},
    ]
    function = prompt.tools[0]["function"]
    assert function["name"] == "get_weather" and function["parameters"] == WEATHER["input_schema"]
    assert not prompt.continue_final_message


def test_final_assistant_text_is_a_prefill():
    prompt = to_chat(request([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]))
    assert prompt.continue_final_message and prompt.conversation[-1] == {
        "role": "assistant",
        "content": "Hello",
    }
    empty = to_chat(request([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": []}]))
    assert not empty.continue_final_message and empty.conversation == [{"role": "user", "content": "Hi"}]


def _use(id_="toolu_1"):
    return {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": id_, "name": "get_weather", "input": {}}],
    }


def _result(id_="toolu_1"):
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": id_, "content": "ok"}]}


HI = {"role": "user", "content": "Hi"}
BAD = [
    ([HI, _use(), _result("toolu_2")], {}, "messages[2].content[0].tool_use_id"),
    ([HI, _result()], {}, "messages[1].content[0].tool_use_id"),
    ([HI, _use(), _use(), _result()], {}, "messages[2].content[0].id"),
    ([{"role": "user", "content": _use()["content"]}], {}, "messages[0].content[0]"),
    ([HI, {"role": "assistant", "content": _result()["content"]}], {}, "messages[1].content[0]"),
    ([{"role": "user", "content": []}], {}, "messages[0].content"),
    ([HI], {"tools": [WEATHER, WEATHER]}, "tools[1].name"),
    ([HI], {"tools": [{**WEATHER, "input_schema": {"type": "string"}}]}, "tools[0].input_schema"),
    ([HI], {"tools": [{**WEATHER, "input_schema": {"type": "object", "properties": {"a": {"type": "foo"}}}}]},
     "tools[0].input_schema"),
    ([HI], {"tool_choice": {"type": "any"}}, "tool_choice"),
    ([HI], {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice.name"),
]  # fmt: skip


@pytest.mark.parametrize("messages, fields, param", BAD, ids=[p for _, _, p in BAD])
def test_what_the_schema_cannot_check_is_400_naming_the_field(messages, fields, param):
    with pytest.raises(OpenAIError) as caught:
        to_chat(request(messages, **fields))
    assert caught.value.status_code == 400 and caught.value.param == param
    assert param in caught.value.message or param.startswith("tool_choice")
    assert caught.value.to_anthropic() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": caught.value.message},
    }


def test_pieces_join_into_blocks():
    pieces = [
        Piece("thinking", "Hm"),
        Piece("thinking", "m."),
        Piece("text", "Sure"),
        Piece("text", "."),
        Piece("tool_use", '{"city"', id="toolu_a", name="get_weather"),
        Piece("tool_use", ': "Paris"}'),
        Piece("tool_use", "", id="toolu_b", name="get_weather"),
        Piece("tool_use", "{}"),
    ]
    assert [b.model_dump() for b in blocks_of(pieces)] == [
        {"type": "thinking", "thinking": "Hmm.", "signature": ""},
        {"type": "text", "text": "Sure."},
        {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "toolu_b", "name": "get_weather", "input": {}},
    ]


@pytest.mark.parametrize(
    "finish, stop, has_tool_use, expected",
    [
        ("length", None, True, ("max_tokens", None)),
        ("stop", "END", False, ("stop_sequence", "END")),
        ("stop", None, True, ("tool_use", None)),
        ("stop", None, False, ("end_turn", None)),
        ("stop", 2, False, ("end_turn", None)),  # a stop token id (EOS) ends the turn
    ],
)
def test_stop_reasons(finish, stop, has_tool_use, expected):
    completion = CompletionOutput(0, "", [], None, None, finish, stop)
    assert stop_reason(completion, has_tool_use) == expected


def test_stream_events_open_extend_and_close_blocks():
    blocks = _Blocks()
    pieces = [
        Piece("thinking", "Hm"),
        Piece("text", "A"),
        Piece("text", "B"),
        Piece("tool_use", "", id="toolu_a", name="f"),
        Piece("tool_use", "{}"),
        Piece("tool_use", "", id="toolu_b", name="f"),
    ]
    events = [e for piece in pieces for e in blocks.events(piece)] + blocks.close()
    parsed = [json.loads(e.split("data: ", 1)[1]) for e in events]
    assert all(e.startswith(f"event: {p['type']}\n") for e, p in zip(events, parsed))
    summary = [
        (p["type"], p["index"], (p.get("delta") or p.get("content_block") or {}).get("type")) for p in parsed
    ]
    assert summary == [
        ("content_block_start", 0, "thinking"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("content_block_start", 3, "tool_use"),
        ("content_block_stop", 3, None),
    ]
    assert parsed[7]["content_block"] == {"type": "tool_use", "id": "toolu_a", "name": "f", "input": {}}
    assert blocks.has_tool_use
