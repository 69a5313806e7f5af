"""gpt-oss's harmony format through the Responses API (`--reasoning-parser openai_gptoss
--tool-call-parser openai`), as vLLM and OpenAI answer it: each harmony message its own output item in
the order written (analysis: a `reasoning` item; a commentary preamble and the final answer: `message`
items; a message to `functions.NAME`: a `function_call` item), streamed with their events; and on input
the reasoning, calls and outputs rendered back through the model's chat template (gpt-oss's reads the
thinking as the assistant message's `thinking`) for a tool loop by `previous_response_id` or by items.

The server's model is a scripted tiny Llama (tests/helpers/scripted_model.py) under a harmony template
written here in gpt-oss's conventions. A script's token occurs once, and harmony repeats its markers,
so the later headers are one special token each (`<|end|><|start|>assistant to=...<|message|>`): the
text the parsers read is the model's, and a step that holds several messages' markers is read too.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import transformers

from helpers.scripted_model import save_scripted_llama
from helpers.server_harness import ServerProcess
from helpers.tiny_models import TINY_PROCESS_XLA_FLAGS
from xlaserve.entrypoints.openai.responses_convert import input_turns, to_chat_request
from xlaserve.entrypoints.openai.responses_harmony import TurnParser
from xlaserve.entrypoints.openai.responses_output import FunctionCallOutput, OutputMessage, ReasoningOutput
from xlaserve.entrypoints.openai.responses_protocol import ResponsesRequest
from xlaserve.entrypoints.openai.responses_stream import EventWriter, OutputStream
from xlaserve.entrypoints.openai.responses_turn import answer_turn
from xlaserve.entrypoints.serving.chat_parsing import ChoiceParser
from xlaserve.entrypoints.serving.chat_template import conversation, template_takes_thinking
from xlaserve.entrypoints.serving.reasoning import get_reasoning_parser
from xlaserve.entrypoints.serving.tool_parsers import get_tool_parser

# gpt-oss's conventions (its Hugging Face template's): a system message, then a developer message with
# the instructions and the tools; an assistant turn with calls shows its `thinking` as an analysis
# message unless a final answer follows later, then its first call; a tool result is addressed from
# the last call's function; any other assistant turn is a final message (earlier thinking dropped).
HARMONY_TEMPLATE = (
    "{%- if messages[0].role in ['system', 'developer'] %}{%- set instructions = messages[0].content %}"
    "{%- set turns = messages[1:] %}{%- else %}{%- set instructions = '' %}{%- set turns = messages %}"
    "{%- endif %}<|start|>system<|message|>You are a test model.<|end|>"
    "{%- if instructions or tools %}<|start|>developer<|message|>"
    "{%- if instructions %}# Instructions\n\n{{ instructions }}\n\n{%- endif %}"
    "{%- if tools %}# Tools\n\n{% for tool in tools %}{{ tool.function.name }}\n{% endfor %}{%- endif %}"
    "<|end|>{%- endif %}"
    "{%- set last = namespace(name=none) %}"
    "{%- for m in turns %}"
    "{%- if m.role == 'assistant' and 'tool_calls' in m %}"
    "{%- set answered = namespace(found=false) %}"
    "{%- for later in turns[loop.index:] %}"
    "{%- if later.role == 'assistant' and 'tool_calls' not in later %}{%- set answered.found = true %}"
    "{%- endif %}{%- endfor %}"
    "{%- if m.content and 'thinking' in m and m.thinking %}"
    "{{- raise_exception('Cannot pass both content and thinking in an assistant message with tool calls') }}"
    "{%- elif 'thinking' in m and not answered.found %}"
    "<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{%- endif %}"
    "{%- set call = m.tool_calls[0].function %}"
    "<|start|>assistant to=functions.{{ call.name }}<|channel|>commentary json<|message|>"
    "{{ call.arguments | tojson }}<|call|>{%- set last.name = call.name %}"
    "{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'tool' %}<|start|>functions.{{ last.name }} to=assistant<|channel|>commentary"
    "<|message|>{{ m.content | tojson }}<|end|>"
    "{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)
# Qwen3's template reads `reasoning_content` and the `enable_thinking` flag: no `thinking` is given to it.
QWEN3_LIKE = "{%- if enable_thinking is defined %}{{ message.reasoning_content }}{%- endif %}"
MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>", "<|call|>", "<|return|>"]
THOUGHT = "The user asks about the weather."
PREAMBLE = "Checking the forecast."
ARGUMENTS = '{"city": "Paris"}'
PREAMBLE_HEADER = "<|start|>assistant<|channel|>commentary<|message|>"
CALL_HEADER = "<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
# The model's answer, one token each: thinking, a preamble, then the call (then EOS: <|call|> stops).
SCRIPT = ["<|channel|>", "analysis", "<|message|>", THOUGHT, "<|end|>", PREAMBLE_HEADER, PREAMBLE,
          CALL_HEADER, ARGUMENTS]  # fmt: skip
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
ASK = "Weather in Paris?"
RESULT = '{"temp_c": 21}'
SERVER_FLAGS = [
    "--enforce-eager", "--served-model-name", "tiny", "--dtype", "bfloat16", "--max-model-len", "512",
    "--max-num-batched-tokens", "64", "--kv-cache-memory", str(2**22),
    "--reasoning-parser", "openai_gptoss", "--tool-call-parser", "openai", "--enable-auto-tool-choice",
]  # fmt: skip
ITEMS = [
    ("reasoning", {"content": [{"type": "reasoning_text", "text": THOUGHT}], "summary": []}),
    ("message", {"content": [{"type": "output_text", "text": PREAMBLE, "annotations": [], "logprobs": []}]}),
    ("function_call", {"name": "get_weather", "arguments": ARGUMENTS}),
]
# The stream of a response with those items, event by event.
EVENTS = [
    "response.created", "response.in_progress",
    "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
    "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
    "response.output_item.added", "response.content_part.added", "response.output_text.delta",
    "response.output_text.done", "response.content_part.done", "response.output_item.done",
    "response.output_item.added", "response.function_call_arguments.delta",
    "response.function_call_arguments.done", "response.output_item.done",
    "response.completed",
]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_scripted_llama(
        str(tmp_path_factory.mktemp("harmony")),
        chat_template=HARMONY_TEMPLATE,
        answer=SCRIPT,
        special_tokens=[*MARKERS, PREAMBLE_HEADER, CALL_HEADER],
    )


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def harmony_server(tmp_path_factory, server_cache_dir, model_dir):
    proc = ServerProcess(
        str(tmp_path_factory.mktemp("harmony-logs")),
        server_cache_dir,
        extra_args=SERVER_FLAGS,
        model=model_dir,
        env={"XLA_FLAGS": f"--xla_force_host_platform_device_count=1 {TINY_PROCESS_XLA_FLAGS}"},
    )
    proc.wait_ready()
    yield proc
    assert proc.stop() == 0, proc.log_tail()


@pytest.fixture(scope="module")
def client(harmony_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=harmony_server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def _check_items(output) -> list[str]:
    """The output's items against ITEMS (ids aside); the call's call_id."""
    dumped = [item.model_dump() if hasattr(item, "model_dump") else item for item in output]
    assert [item["type"] for item in dumped] == [kind for kind, _ in ITEMS]
    for item, (_, fields) in zip(dumped, ITEMS, strict=True):
        assert {k: item[k] for k in fields} == fields, item
        assert item["status"] == "completed"
    assert dumped[1]["role"] == "assistant" and dumped[2]["call_id"].startswith("call_")
    assert len({item["id"] for item in dumped}) == 3
    return dumped[2]["call_id"]


def _hand_prompt(tokenizer, call_id: str, *more) -> list[int]:
    """The second turn's prompt as gpt-oss's template renders the loop written by hand: the preamble a
    final message of its own (the template takes a call's thinking or its text, not both), the call's
    thinking as `thinking`, its arguments an object, the tool's result."""
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }
    messages = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": PREAMBLE},
        {"role": "assistant", "content": "", "thinking": THOUGHT, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": RESULT},
        *more,
    ]
    tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    analysis = "<|channel|>analysis<|message|>" + THOUGHT
    assert (analysis in text) == (not more) and "<|start|>functions.get_weather to=assistant" in text
    return tokenizer.encode(text, add_special_tokens=False)


# -- one model turn: items and events ---------------------------------------------------------------


@pytest.mark.slow  # the module's server (a tiny model)
def test_items_and_usage_not_streamed(client, tokenizer):
    response = client.responses.create(model="tiny", input=ASK, tools=[WEATHER], temperature=0.0)
    assert response.status == "completed"
    _check_items(response.output)
    assert response.usage.output_tokens == len(SCRIPT) + 1  # and EOS
    assert response.usage.output_tokens_details.reasoning_tokens == len(
        tokenizer.encode(THOUGHT, add_special_tokens=False)
    )


@pytest.mark.slow  # the module's server (a tiny model)
def test_events_streamed(harmony_server):
    body = {"model": "tiny", "input": ASK, "tools": [WEATHER], "temperature": 0.0, "stream": True}
    with httpx.stream("POST", harmony_server.url + "/v1/responses", json=body, timeout=300) as reply:
        assert reply.status_code == 200
        events = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == EVENTS
    assert [e["sequence_number"] for e in events] == list(range(len(EVENTS)))
    by_type = {e["type"]: e for e in events}
    assert by_type["response.reasoning_text.delta"]["delta"] == THOUGHT
    assert by_type["response.reasoning_text.done"]["text"] == THOUGHT
    assert by_type["response.output_text.delta"]["delta"] == PREAMBLE
    assert by_type["response.function_call_arguments.delta"]["delta"] == ARGUMENTS
    done = by_type["response.function_call_arguments.done"]
    assert (done["name"], done["arguments"], done["output_index"]) == ("get_weather", ARGUMENTS, 2)
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [(e["output_index"], e["item"]["type"]) for e in added] == [
        (0, "reasoning"), (1, "message"), (2, "function_call")
    ]  # fmt: skip
    finished = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    _check_items(finished)
    assert events[-1]["response"]["output"] == finished


# -- a tool loop: the items back through the template -------------------------------------------------


@pytest.mark.slow  # the module's server (a tiny model)
def test_tool_loop_by_previous_response_id_and_by_items(client, tokenizer):
    first = client.responses.create(model="tiny", input=ASK, tools=[WEATHER], temperature=0.0)
    call_id = _check_items(first.output)
    expected = _hand_prompt(tokenizer, call_id)
    output = {"type": "function_call_output", "call_id": call_id, "output": RESULT}
    second = client.responses.create(
        model="tiny", previous_response_id=first.id, input=[output], tools=[WEATHER], temperature=0.0
    )
    assert second.usage.input_tokens == len(expected)
    _check_items(second.output)  # the script again: the same items, a new call
    # The first response's items given back instead: the same prompt.
    items = [item.model_dump(exclude_none=True) for item in first.output]
    by_items = client.responses.create(
        model="tiny",
        input=[{"role": "user", "content": ASK}, *items, output],
        tools=[WEATHER],
        temperature=0.0,
    )
    assert by_items.usage.input_tokens == len(expected)
    _check_items(by_items.output)


def test_items_render_as_the_template_applied_by_hand(tokenizer):
    """The chat messages the items become (sent back, or a stored response's turn), rendered by the
    template, are the hand-written loop's ids, and a loop whose call was answered by a final message
    drops the call's thinking (the template's rule)."""
    call_id = "call_1"
    items = [
        {"type": "message", "role": "user", "content": ASK},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": THOUGHT}], "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": PREAMBLE}]},
        {"type": "function_call", "call_id": call_id, "name": "get_weather", "arguments": ARGUMENTS},
        {"type": "function_call_output", "call_id": call_id, "output": RESULT},
    ]

    def rendered(input_items, history=()) -> list[int]:
        req = ResponsesRequest.model_validate({"model": "tiny", "input": input_items, "tools": [WEATHER]})
        chat = to_chat_request(req, [*history, *input_turns(req, list(history))])
        tools = [tool.model_dump(exclude_none=True) for tool in chat.tools]
        messages = conversation(chat.messages, takes_thinking=template_takes_thinking(HARMONY_TEMPLATE))
        text = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        return tokenizer.encode(text, add_special_tokens=False)

    assert template_takes_thinking(HARMONY_TEMPLATE) and not template_takes_thinking(QWEN3_LIKE)
    assert rendered(items) == _hand_prompt(tokenizer, call_id)
    answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]}
    later = [*items, answer, {"type": "message", "role": "user", "content": "Thanks."}]
    final = [{"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks."}]
    hand = _hand_prompt(tokenizer, call_id, *final)
    assert rendered(later) == hand
    # A stored response's turn (`previous_response_id`): the script's items, parsed as the server does,
    # as the assistant turn the store keeps.
    _, made = _stream(SCRIPT)
    history = [{"role": "user", "content": ASK}, answer_turn([_item(item) for item in made])]
    output = {"type": "function_call_output", "call_id": made[2]["call_id"], "output": RESULT}
    assert rendered([output], history) == _hand_prompt(tokenizer, made[2]["call_id"])


def test_parallel_calls_go_back_a_turn_each_with_their_outputs(tokenizer):
    """gpt-oss's template renders a turn's first call only and names a result after the last call: two
    parallel calls sent back (outputs in the other order) render as harmony writes them, each call
    followed by its own result, the thinking before the first."""
    clock = {"type": "function", "name": "get_time", "parameters": {"type": "object"}}
    items = [
        {"type": "message", "role": "user", "content": ASK},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": THOUGHT}], "summary": []},
        {"type": "function_call", "call_id": "a", "name": "get_weather", "arguments": ARGUMENTS},
        {"type": "function_call", "call_id": "b", "name": "get_time", "arguments": '{"zone": "CET"}'},
        {"type": "function_call_output", "call_id": "b", "output": "noon"},
        {"type": "function_call_output", "call_id": "a", "output": RESULT},
    ]
    req = ResponsesRequest.model_validate({"model": "tiny", "input": items, "tools": [WEATHER, clock]})
    chat = to_chat_request(req, input_turns(req, []))
    assert [len(m.tool_calls or ()) for m in chat.messages if m.role == "assistant"] == [2]  # one turn
    messages = conversation(chat.messages, takes_thinking=True)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    call, result = "<|channel|>commentary json<|message|>", " to=assistant<|channel|>commentary<|message|>"
    expected = [
        f"<|start|>assistant<|channel|>analysis<|message|>{THOUGHT}<|end|>",
        f"<|start|>assistant to=functions.get_weather{call}{ARGUMENTS}<|call|>",
        f"<|start|>functions.get_weather{result}{json.dumps(RESULT)}<|end|>",
        f'<|start|>assistant to=functions.get_time{call}{{"zone": "CET"}}<|call|>',
        f'<|start|>functions.get_time{result}"noon"<|end|><|start|>assistant',
    ]
    assert text.endswith("".join(expected)), text
    # Other templates get the turn as it was.
    assert [m["role"] for m in conversation(chat.messages)] == ["user", "assistant", "tool", "tool"]


# -- the parse behind the items, token by token --------------------------------------------------------


class FakeTokenizer:
    def get_vocab(self):
        return {"<|channel|>": 5, "<|message|>": 6, "<|start|>": 7}

    def encode(self, text, add_special_tokens=False):
        return [{"final": 2}[text]]


def _item(dumped: dict):
    kinds = {"reasoning": ReasoningOutput, "message": OutputMessage, "function_call": FunctionCallOutput}
    return kinds[dumped["type"]].model_validate(dumped)


def _stream(pieces: list[str]) -> tuple[list[dict], list[dict]]:
    parser = ChoiceParser(get_reasoning_parser("openai_gptoss")(FakeTokenizer()), get_tool_parser("openai")())
    turn, stream = TurnParser(parser), OutputStream(EventWriter())
    events = [e for piece in pieces for delta in turn.feed(piece) for e in stream.feed(delta)]
    events += [e for delta in turn.finish() for e in stream.feed(delta)] + stream.close("completed")
    payloads = [json.loads(event.split("data: ", 1)[1]) for event in events]
    return payloads, [item.model_dump() for item in stream.items]


def test_a_long_turn_is_read_once_not_again_per_piece(monkeypatch):
    """Each piece re-reads only the message still open: 150 messages fed token by token are read in work
    linear in the text (re-reading the whole turn per piece: ~500 times the text here), marked alike."""
    from xlaserve.entrypoints.openai import responses_harmony

    pieces = [
        "<|channel|>",
        "analysis",
        "<|message|>",
        "Thinking",
        " on.",
        "<|end|>",
        "<|start|>assistant",
    ] * 150
    read = []
    real = responses_harmony.read_messages
    monkeypatch.setattr(
        responses_harmony, "read_messages", lambda text, final: read.append(len(text)) or real(text, final)
    )
    parser = ChoiceParser(get_reasoning_parser("openai_gptoss")(FakeTokenizer()), get_tool_parser("openai")())
    turn = TurnParser(parser)
    marks = [delta.message for piece in pieces for delta in turn.feed(piece)]
    assert sum(read) < 10 * len("".join(pieces))  # the open message again per piece: ~5x
    assert marks == sorted(marks) and sorted(set(marks)) == list(range(150))


def test_each_harmony_message_is_its_own_item_in_order():
    """Two analysis messages are two reasoning items, a preamble and the final answer two messages, and
    a step that holds the end of one message and the start of the next (several tokens) splits too."""
    pieces = ["<|channel|>", "analysis", "<|message|>", "First", " thought.", "<|end|>",
              "<|start|>assistant<|channel|>analysis<|message|>Second.<|end|><|start|>", "assistant",
              "<|channel|>", "commentary", "<|message|>", "Let me see.", "<|end|>", "<|start|>", "assistant",
              "<|channel|>final<|message|>", "It is ", "sunny."]  # fmt: skip
    payloads, items = _stream(pieces)
    assert [(item["type"], (item["content"] or [{}])[0].get("text")) for item in items] == [
        ("reasoning", "First thought."),
        ("reasoning", "Second."),
        ("message", "Let me see."),
        ("message", "It is sunny."),
    ]
    added = [p["output_index"] for p in payloads if p["type"] == "response.output_item.added"]
    done = [p["output_index"] for p in payloads if p["type"] == "response.output_item.done"]
    assert added == done == [0, 1, 2, 3]
    deltas = [(p["type"].split(".")[1], p["delta"]) for p in payloads if p["type"].endswith(".delta")]
    assert deltas == [
        ("reasoning_text", "First"), ("reasoning_text", " thought."), ("reasoning_text", "Second."),
        ("output_text", "Let me see."), ("output_text", "It is"), ("output_text", " sunny."),
    ]  # fmt: skip
    # The whole text at once (one step) makes the same items.
    assert [(i["type"], i["content"]) for i in _stream(["".join(pieces)])[1]] == [
        (i["type"], i["content"]) for i in items
    ]


def test_calls_between_thoughts_keep_their_order():
    call = (
        '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone": "CET"}<|call|>'
    )
    _, items = _stream(["<|channel|>analysis<|message|>Time first.<|end|>", call])
    assert [(i["type"], i.get("name"), i.get("arguments")) for i in items] == [
        ("reasoning", None, None),
        ("function_call", "get_time", '{"zone": "CET"}'),
    ]
