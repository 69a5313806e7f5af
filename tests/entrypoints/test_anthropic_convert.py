"""The Messages API's host-side pieces without a server: a request as a chat completions request
(tool_use as tool_calls, tool_result as tool messages, tool_choice, prefill), the checks the schema
cannot make, a scripted model output read as blocks and as stream pieces (thinking and calls through the
chat path's own parsers), stop reasons, and the stream's events for a scripted sequence of pieces."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic_core import from_json

from xlaserve.engine.core_client import EngineDeadError
from xlaserve.entrypoints.anthropic.convert import to_chat_request
from xlaserve.entrypoints.anthropic.output import Piece, stop_reason
from xlaserve.entrypoints.anthropic.protocol import MessagesRequest
from xlaserve.entrypoints.anthropic.reading import ChoiceReader
from xlaserve.entrypoints.anthropic.streaming import Blocks, event_stream
from xlaserve.entrypoints.serving.chat_parsing import ChoiceParser
from xlaserve.entrypoints.serving.errors import APIError
from xlaserve.entrypoints.serving.reasoning import get_reasoning_parser
from xlaserve.entrypoints.serving.tool_parsers import NamedToolParser, RequiredToolParser, get_tool_parser
from xlaserve.outputs import CompletionOutput, RequestOutput

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
HI = {"role": "user", "content": "Hi"}


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
    chat = to_chat_request(req)
    function = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assistant = {"role": "assistant", "content": "Let me check.", "reasoning_content": "Use the tool.",
                 "tool_calls": [{"id": "toolu_1", "type": "function", "function": function}]}  # fmt: skip
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        assistant,
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
        {"role": "user", "content": "Thanks!"},
    ]
    tool = chat.tools[0].function
    assert tool.name == "get_weather" and tool.parameters == WEATHER["input_schema"]
    assert chat.add_generation_prompt and not chat.continue_final_message
    assert chat.max_tokens == 4 and chat.tool_choice is None


@pytest.mark.parametrize(
    "choice, expected",
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "any", "disable_parallel_tool_use": True}, "required"),
        ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
    ],
)
def test_tool_choice_and_sampling_map_to_the_chat_request(choice, expected):
    fields = {
        "tools": [WEATHER],
        "tool_choice": choice,
        "stop_sequences": ["END"],
        "temperature": 0,
        "top_k": 5,
    }
    chat = to_chat_request(request([HI], **fields))
    assert (
        chat.tool_choice if isinstance(chat.tool_choice, str) else chat.tool_choice.model_dump()
    ) == expected
    assert chat.parallel_tool_calls is (False if choice.get("disable_parallel_tool_use") else None)
    assert (chat.stop, chat.temperature, chat.top_k, chat.max_tokens) == (["END"], 0, 5, 4)


@pytest.mark.parametrize("strict", [None, True, False])
def test_a_tools_strict_reaches_the_chat_function(strict):
    """Anthropic's tool `strict` (the SDK's ToolParam sends it; eager_input_streaming too) is OpenAI's
    function `strict`: the same tool plan on both routes."""
    tool = {**WEATHER, "eager_input_streaming": True} | ({} if strict is None else {"strict": strict})
    function = to_chat_request(request([HI], tools=[tool])).tools[0].function
    assert (function.name, function.strict) == ("get_weather", strict)


def test_final_assistant_text_is_a_prefill():
    chat = to_chat_request(request([HI, {"role": "assistant", "content": "Hello"}]))
    assert chat.continue_final_message and not chat.add_generation_prompt
    assert (chat.messages[-1].role, chat.messages[-1].content) == ("assistant", "Hello")
    empty = to_chat_request(request([HI, {"role": "assistant", "content": []}]))
    assert not empty.continue_final_message and [m.role for m in empty.messages] == ["user"]


def _use(id_="toolu_1"):
    return {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": id_, "name": "get_weather", "input": {}}],
    }


def _result(id_="toolu_1"):
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": id_, "content": "ok"}]}


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
    ([HI], {"output_config": {"format": {"type": "json_schema", "schema": {"type": "foo"}}}},
     "output_config.format.schema"),
    ([HI], {"output_config": {"format": {"type": "json_schema", "schema": {"$ref": "#/nowhere"}}}},
     "output_config.format.schema"),
    ([HI], {"tools": [WEATHER], "tool_choice": {"type": "any"},
            "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
     "output_config.format"),
]  # fmt: skip


def test_output_config_format_is_a_json_schema_response_format():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    chat = to_chat_request(request([HI], output_config={"format": {"type": "json_schema", "schema": schema}}))
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.schema_ == schema
    assert to_chat_request(request([HI], output_config={"effort": "low"})).response_format is None


@pytest.mark.parametrize(
    "thinking, enable_thinking",
    [
        (None, None),
        ({"type": "enabled", "budget_tokens": 1024}, True),
        ({"type": "adaptive"}, True),
        ({"type": "disabled"}, False),
    ],
)
def test_thinking_is_the_templates_enable_thinking(thinking, enable_thinking):
    chat = to_chat_request(request([HI], **({} if thinking is None else {"thinking": thinking})))
    kwargs = chat.chat_template_kwargs or {}
    assert kwargs.get("enable_thinking") is enable_thinking


def test_chat_template_kwargs_pass_on_and_thinking_sets_enable_thinking_over_them():
    """vLLM's chat_template_kwargs reach the chat request as sent; Anthropic's `thinking` overrides their
    enable_thinking, and only that."""
    kwargs = {"enable_thinking": False, "custom": [1, 2]}
    assert to_chat_request(request([HI], chat_template_kwargs=kwargs)).chat_template_kwargs == kwargs
    thinking = request([HI], chat_template_kwargs=kwargs, thinking={"type": "adaptive"})
    assert to_chat_request(thinking).chat_template_kwargs == {"enable_thinking": True, "custom": [1, 2]}
    assert to_chat_request(request([HI], chat_template_kwargs={})).chat_template_kwargs is None


@pytest.mark.parametrize("messages, fields, param", BAD, ids=[p for _, _, p in BAD])
def test_what_the_schema_cannot_check_is_400_naming_the_field(messages, fields, param):
    with pytest.raises(APIError) as caught:
        to_chat_request(request(messages, **fields))
    assert caught.value.status_code == 400 and caught.value.param == param
    assert param.split(".")[0] in caught.value.message
    assert caught.value.to_anthropic() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": caught.value.message},
    }


class ThinkTokenizer:
    def get_vocab(self):
        return {"<think>": 10, "</think>": 11}


def _reader(tools, request=None) -> ChoiceReader:
    reasoning = get_reasoning_parser("deepseek_r1")(ThinkTokenizer(), prompt_token_ids=[1, 10])
    return ChoiceReader(ChoiceParser(reasoning, tools, request))


CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
OUTPUT = f"Paris, so the tool.</think>Checking.<tool_call>\n{CALL}\n</tool_call>"


def test_output_read_whole_and_streamed_gives_the_same_blocks():
    """deepseek_r1's thinking and hermes' calls, as blocks; streamed in 7-character pieces, the pieces
    make the same blocks (ids aside)."""
    whole = _reader(get_tool_parser("hermes")()).blocks(OUTPUT)
    assert [b.model_dump() for b in whole] == [
        {"type": "thinking", "thinking": "Paris, so the tool.", "signature": ""},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": whole[2].id, "name": "get_weather", "input": {"city": "Paris"}},
    ]
    reader = _reader(get_tool_parser("hermes")())
    pieces = [p for i in range(0, len(OUTPUT), 7) for p in reader.feed(OUTPUT[i : i + 7])] + reader.flush()
    kinds = [p.kind for p in pieces]
    assert kinds == sorted(kinds, key=["thinking", "text", "tool_use"].index)  # blocks in order, each whole
    assert "".join(p.text for p in pieces if p.kind == "thinking") == "Paris, so the tool."
    assert "".join(p.text for p in pieces if p.kind == "text") == "Checking."
    calls = [p for p in pieces if p.kind == "tool_use"]
    assert [(p.id is not None, p.name) for p in calls][0] == (True, "get_weather")
    assert all(p.id is None for p in calls[1:])
    assert json.loads("".join(p.text for p in calls)) == {"city": "Paris"}


def _forced(tool_parser, reasoning=None) -> ChoiceReader:
    return ChoiceReader(ChoiceParser(reasoning, tool_parser, None, is_forced=True))


def _streamed(reader: ChoiceReader, output: str, size: int = 5) -> list[dict]:
    """The blocks a client accumulates from the reader's pieces of `output`, fed `size` characters at a
    time (as Anthropic's SDK does: a call's input is the partial parse of its JSON)."""
    blocks: list[dict] = []
    pieces = [p for i in range(0, len(output), size) for p in reader.feed(output[i : i + size])]
    for piece in pieces + reader.flush():
        if piece.kind == "tool_use" and piece.id is not None:
            blocks.append({"type": "tool_use", "name": piece.name, "json": piece.text})
        elif blocks and blocks[-1]["type"] == piece.kind:
            blocks[-1]["json" if piece.kind == "tool_use" else piece.kind] += piece.text
        else:
            blocks.append({"type": piece.kind, piece.kind: piece.text})
    for block in blocks:
        if block["type"] == "tool_use":
            text = block.pop("json")
            block["input"] = from_json(text, allow_partial=True) if text else {}
    return blocks


def _dumped(blocks) -> list[dict]:
    return [b.model_dump(exclude={"id", "signature"}) for b in blocks]


def test_forced_call_output_is_a_tool_use_block():
    (block,) = _forced(NamedToolParser("get_weather")).blocks('{"city": "Oslo"}')
    assert (block.type, block.name, block.input) == ("tool_use", "get_weather", {"city": "Oslo"})


NAMED_CUTS = ['{"city": "Os', '{"city": "Oslo", "un', "{", "", " "]
REQUIRED = (
    '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, '
    '{"name": "get_time", "parameters": {"city": "Lima"}}]'
)
REQUIRED_CUTS = [REQUIRED[:n] for n in (3, 12, 30, 50, 57, 64, 80, 90, 100, len(REQUIRED) - 1)]


@pytest.mark.parametrize("output", NAMED_CUTS)
def test_forced_named_call_cut_by_max_tokens_is_a_tool_use_block_streamed_or_not(output):
    """Cut off mid-call: a tool_use block whose input is what the SDK reads from the streamed JSON; never
    a text block of raw JSON. A stream gives the same blocks."""
    whole = _forced(NamedToolParser("get_weather")).blocks(output)
    assert all(b.type == "tool_use" for b in whole)
    assert _dumped(whole) == _streamed(_forced(NamedToolParser("get_weather")), output)


@pytest.mark.parametrize("output", REQUIRED_CUTS, ids=[str(len(o)) for o in REQUIRED_CUTS])
def test_forced_any_cut_by_max_tokens_is_tool_use_blocks_only(output):
    """tool_choice any, its call list cut anywhere: tool_use blocks only (the issue's text block of raw
    call JSON before the calls is gone), the same streamed."""
    whole = _forced(RequiredToolParser()).blocks(output)
    assert all(b.type == "tool_use" for b in whole), _dumped(whole)
    assert _dumped(whole) == _streamed(_forced(RequiredToolParser()), output)
    names = [b.name for b in whole]
    assert names == ["get_weather", "get_time"][: len(names)]
    assert all(
        b.input.items() <= {"city": "Oslo" if b.name == "get_weather" else "Lima"}.items() for b in whole
    )
    complete = _forced(RequiredToolParser()).blocks(REQUIRED)
    assert [(b.name, b.input) for b in complete] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {"city": "Lima"}),
    ]


def test_forced_call_keeps_the_thinking_before_it():
    reasoning = get_reasoning_parser("deepseek_r1")(ThinkTokenizer(), prompt_token_ids=[1, 10])
    output = 'Oslo it is.</think>{"city": "Oslo"}'
    whole = _forced(NamedToolParser("get_weather"), reasoning).blocks(output)
    assert _dumped(whole) == [
        {"type": "thinking", "thinking": "Oslo it is."},
        {"type": "tool_use", "name": "get_weather", "input": {"city": "Oslo"}},
    ]
    reasoning = get_reasoning_parser("deepseek_r1")(ThinkTokenizer(), prompt_token_ids=[1, 10])
    assert _streamed(_forced(NamedToolParser("get_weather"), reasoning), output) == _dumped(whole)


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
    blocks = Blocks()
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


class ScriptedStream:
    """A request stream that yields deltas, then raises (or ends)."""

    def __init__(self, texts, error=None):
        outputs = [CompletionOutput(0, text, [7], None, None, None, None) for text in texts]
        self.items = [RequestOutput("r", None, [1], None, [output], False) for output in outputs]
        self.error = error
        self.is_closed = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.items:
            return self.items.pop(0)
        if self.error is not None:
            raise self.error
        raise StopAsyncIteration

    def close(self):
        self.is_closed = True


def test_an_error_mid_stream_is_an_error_event_and_ends_the_stream():
    stream = ScriptedStream(["Hel", "lo"], EngineDeadError("core pid 123 died"))
    reader = ChoiceReader(ChoiceParser(None, None, None))

    async def collect():
        return [e async for e in event_stream("msg_1", "m", stream, 5, reader, with_details=False)]

    events = asyncio.run(collect())
    names = [e.split("\n", 1)[0].removeprefix("event: ") for e in events]
    deltas = ["content_block_delta"] * 2
    assert names == ["message_start", "ping", "content_block_start", *deltas, "error"]
    error = json.loads(events[-1].split("data: ", 1)[1])
    assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"
    assert "123" not in error["error"]["message"] and stream.is_closed


def test_an_error_before_the_first_output_is_the_streams_only_event():
    """message_start waits for the engine's first output (its usage needs the prefix cache's counts), so
    a request that fails before it streams one `error` event and no message."""
    stream = ScriptedStream([], EngineDeadError("core pid 123 died"))
    reader = ChoiceReader(ChoiceParser(None, None, None))

    async def collect():
        return [e async for e in event_stream("msg_1", "m", stream, 5, reader, with_details=True)]

    events = asyncio.run(collect())
    assert [e.split("\n", 1)[0].removeprefix("event: ") for e in events] == ["error"]
    assert json.loads(events[0].split("data: ", 1)[1])["error"]["type"] == "overloaded_error"
    assert stream.is_closed
