"""The chat route's tool and reasoning plumbing without a server: tool_choice plans and their
grammars, one choice's text through a reasoning parser and a tool parser (streamed at every split),
and the server flags."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import jinja2
import jsonschema
import pytest

from xlaserve.engine.mm_processor import content_format
from xlaserve.entrypoints.arg_utils import add_tool_args, auto_tool_choice, tool_options
from xlaserve.entrypoints.serving.chat_parsing import ChoiceParser, make_tool_parser
from xlaserve.entrypoints.serving.chat_path import chat_sampling_params, choice_parser
from xlaserve.entrypoints.serving.chat_protocol import ChatCompletionRequest, ChatMessage
from xlaserve.entrypoints.serving.chat_template import conversation, render_chat
from xlaserve.entrypoints.serving.errors import APIError
from xlaserve.entrypoints.serving.reasoning import get_reasoning_parser
from xlaserve.entrypoints.serving.tool_parsers import HermesToolParser, get_tool_parser
from xlaserve.entrypoints.serving.tools import plan_tools, tools_in_system_prompt

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "ping"}},
]


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], **fields})


def test_required_plan_is_a_list_of_calls_of_the_tools():
    plan = plan_tools(request(tools=TOOLS, tool_choice="required"), enable_auto_tool_choice=False)
    schema = json.loads(json.dumps(plan.structured_outputs.json))
    valid = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "ping", "parameters": {}}]
    jsonschema.validate(valid, schema)
    for invalid in ([], [{"name": "nope", "parameters": {}}], [{"name": "get_weather", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(invalid, schema)
    single = plan_tools(request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), False)
    assert single.structured_outputs.json["maxItems"] == 1


def test_named_plan_is_the_functions_parameters():
    choice = {"type": "function", "function": {"name": "get_weather"}}
    plan = plan_tools(request(tools=TOOLS, tool_choice=choice), False)
    assert (plan.choice, plan.function_name, plan.structured_outputs.json) == (
        "named",
        "get_weather",
        WEATHER,
    )
    ping = plan_tools(
        request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "ping"}}), False
    )
    assert ping.structured_outputs.json["properties"] == {}  # no parameters: an empty object


@pytest.mark.parametrize(
    ("fields", "auto", "choice"),
    [
        ({"tools": TOOLS}, True, "auto"),
        ({"tools": TOOLS}, False, "none"),
        ({}, True, "none"),
        ({"tools": TOOLS, "tool_choice": "none"}, True, "none"),
    ],
)
def test_default_choice(fields, auto, choice):
    assert plan_tools(request(**fields), auto).choice == choice


def test_auto_without_the_flag_is_400():
    with pytest.raises(APIError) as error:
        plan_tools(request(tools=TOOLS, tool_choice="auto"), enable_auto_tool_choice=False)
    assert error.value.status_code == 400 and error.value.param == "tool_choice"


THOUGHT_AND_CALL = (
    "The user wants weather.\n</think>\n\nLet me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


def _parser(choice="auto"):
    plan = plan_tools(request(tools=TOOLS, tool_choice=choice), True)
    return ChoiceParser(get_reasoning_parser("deepseek_r1")(), make_tool_parser(plan, HermesToolParser, None))


def test_reasoning_then_calls_one_shot():
    parsed = _parser().parse(THOUGHT_AND_CALL)
    assert parsed.reasoning == "The user wants weather.\n"
    assert parsed.content == "Let me check."
    assert [(c.function.name, c.function.arguments) for c in parsed.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]


@pytest.mark.parametrize("cut", range(len(THOUGHT_AND_CALL) + 1))
def test_reasoning_then_calls_streamed_at_every_split(cut):
    parser = _parser()
    reasoning = content = ""
    calls: dict[int, list[str]] = {}
    for delta in (parser.feed(THOUGHT_AND_CALL[:cut]), parser.feed(THOUGHT_AND_CALL[cut:]), parser.finish()):
        reasoning += delta.reasoning or ""
        content += delta.content or ""
        for tc in delta.tool_calls:
            calls.setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments or ""
    assert (reasoning, content) == ("The user wants weather.\n", "Let me check.")
    assert list(calls.values()) == [["get_weather", '{"city": "Paris"}']]
    assert parser.num_calls_sent == 1


def test_a_parser_that_raises_leaves_the_text_as_content():
    class Broken(HermesToolParser):
        def _parse(self, text, final, keep_broken):
            raise RuntimeError("bug")

    parser = ChoiceParser(None, Broken())
    assert parser.parse("hello").content == "hello"
    assert parser.feed("hel").content == "hel" and parser.feed("lo").content == "lo"


def test_tools_go_into_the_system_prompt_for_templates_without_tools():
    chat = tools_in_system_prompt([{"role": "user", "content": "Hi"}], [TOOLS[0]])
    assert chat[0]["role"] == "system" and '"name": "get_weather"' in chat[0]["content"]
    assert "<tool_call>" in chat[0]["content"]
    merged = tools_in_system_prompt([{"role": "system", "content": "Be brief."}, *chat[1:]], [TOOLS[0]])
    assert merged[0]["content"].startswith("Be brief.\n\n# Tools") and len(merged) == 2
    as_parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}]  # the "openai" format
    assert tools_in_system_prompt(as_parts, [TOOLS[0]])[0]["content"][1]["text"].startswith("# Tools")


def test_chat_template_content_format():
    """--chat-template-content-format: "string" joins a message's parts into one string, "openai" gives
    the template the parts (a media part as {"type": "image"}); "auto" is "openai" for a template that
    loops over a message's content, as vLLM detects it."""
    loops = "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}"
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert [content_format(t, "auto") for t in (loops, plain)] == ["openai", "string"]
    assert content_format(loops, "string") == "string" and content_format(plain, "openai") == "openai"
    image = {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}
    message = ChatMessage(role="user", content=[{"type": "text", "text": "Hi"}, image])
    assert conversation([message], image_placeholder="<image>")[0]["content"] == "Hi<image>\n"
    parts = [{"type": "text", "text": "Hi"}, {"type": "image"}]
    assert conversation([message], image_placeholder="<image>", as_parts=True)[0]["content"] == parts


def _args(*argv, model=None):
    parser = argparse.ArgumentParser()
    add_tool_args(parser)
    args = parser.parse_args(list(argv))
    args.model = model
    return args


def test_server_flags(tmp_path):
    options = tool_options(_args("--enable-auto-tool-choice", "--tool-call-parser", "hermes"))
    assert options["enable_auto_tool_choice"] and options["tool_parser_cls"] is HermesToolParser
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'"):
        tool_options(_args("--tool-call-parser", "nope"))
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        tool_options(_args("--reasoning-parser", "nope"))
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        tool_options(_args("--enable-auto-tool-choice"))  # the embedded model: no family default
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    options = tool_options(_args("--enable-auto-tool-choice", model=str(tmp_path)))
    assert options["tool_parser_cls"] is HermesToolParser  # Qwen2's default


# -- a forced tool choice: calls only, a stream and a one-shot answer alike -------------------------

REQUIRED_OUTPUT = (
    '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "ping", "parameters": {}}]'
)
FORCED_CUTS = [
    ("required", REQUIRED_OUTPUT[:n]) for n in (0, 3, 12, 30, 44, 56, 70, 80, 90, len(REQUIRED_OUTPUT) - 1)
] + [("named", text) for text in ('{"city": "Os', '{"city": "Oslo"', "{", " ", '{"city": "Oslo"}')]
NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def _forced_parser(choice, reasoning=None) -> ChoiceParser:
    """The factory every chat-path route uses (serving/chat_path.py), on a stand-in server."""
    state = SimpleNamespace(
        tool_parser_cls=HermesToolParser,
        reasoning_parser_cls=reasoning,
        engine=SimpleNamespace(tokenizer=None),
    )
    tool_choice = "required" if choice == "required" else NAMED_WEATHER
    req = request(tools=TOOLS, tool_choice=tool_choice)
    return choice_parser(state, req, plan_tools(req, False), [])


def _accumulated(parser: ChoiceParser, output: str, size: int = 4):
    """(content, [(name, arguments)]) as a client accumulates the stream of `output`."""
    deltas = [parser.feed(output[i : i + size]) for i in range(0, len(output), size)] + [parser.finish()]
    content, calls = "", {}
    for delta in deltas:
        content += delta.content or ""
        for tc in delta.tool_calls:
            calls.setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments or ""
    return content or None, [tuple(c) for c in calls.values()]


@pytest.mark.parametrize("choice, output", FORCED_CUTS, ids=[f"{c}-{len(o)}" for c, o in FORCED_CUTS])
def test_forced_choice_is_calls_only_and_one_shot_equals_the_stream(choice, output):
    """tool_choice required / named, the output cut anywhere (max_tokens): no content, ever (never the
    call list's raw JSON as text), and the one-shot parse is what a client accumulates from the stream,
    a cut call's arguments as far as they went."""
    whole = _forced_parser(choice).parse(output)
    content, calls = _accumulated(_forced_parser(choice), output)
    assert whole.content is None and content is None
    assert [(c.function.name, c.function.arguments) for c in whole.tool_calls] == calls
    assert len({c.id for c in whole.tool_calls}) == len(whole.tool_calls)
    if output == REQUIRED_OUTPUT[:90]:  # the second call's arguments begun, not ended
        assert calls == [("get_weather", '{"city": "Oslo"}'), ("ping", "{")]


def test_forced_choice_keeps_the_thinking():
    reasoning = get_reasoning_parser("deepseek_r1")
    output = 'Oslo.</think>{"city": "Oslo"}'
    whole = _forced_parser("named", reasoning).parse(output)
    assert whole.reasoning == "Oslo." and whole.content is None
    assert [(c.function.name, c.function.arguments) for c in whole.tool_calls] == [
        ("get_weather", '{"city": "Oslo"}')
    ]


def test_auto_choice_is_not_forced():
    req = request(tools=TOOLS, tool_choice="auto")
    state = SimpleNamespace(
        tool_parser_cls=HermesToolParser, reasoning_parser_cls=None, engine=SimpleNamespace(tokenizer=None)
    )
    parser = choice_parser(state, req, plan_tools(req, True), [])
    assert not parser.is_forced and parser.parse("Hello.").content == "Hello."


@pytest.mark.parametrize("switches", [None, {"thinking": True}, {"enable_thinking": True}])
def test_chat_template_kwargs_reach_the_reasoning_parser(switches):
    """DeepSeek-V3.1's thinking is the request's template switch, which the prompt shows no tag of: the
    chat path hands the request's chat_template_kwargs to the parser, which then splits the answer and
    makes structured output wait for </think> (off: all answer, the grammar from the first token)."""

    class Tokenizer:
        def get_vocab(self):
            return {"<think>": 10, "</think>": 11}

    state = SimpleNamespace(
        tool_parser_cls=None,
        reasoning_parser_cls=get_reasoning_parser("deepseek_v3"),
        engine=SimpleNamespace(tokenizer=Tokenizer()),
        default_sampling={},
    )
    req = request(chat_template_kwargs=switches, structured_outputs={"regex": "[0-9]+"})
    plan = plan_tools(req, False)
    parsed = choice_parser(state, req, plan, [1, 2]).parse("Two.</think>2")
    gate = chat_sampling_params(state, req, plan, [1, 2], 8).structured_outputs.reasoning_end_token_id
    if switches is None:
        assert (parsed.reasoning, parsed.content, gate) == (None, "Two.</think>2", None)
    else:
        assert (parsed.reasoning, parsed.content, gate) == ("Two.", "2", 11)
    # olmo3's </think> is text, which no token id can gate: a 400 naming the field, not a grammar on the
    # thinking
    state.reasoning_parser_cls = get_reasoning_parser("olmo3")
    with pytest.raises(APIError, match="olmo3 reasoning parser") as error:
        chat_sampling_params(state, req, plan, [1, 2], 8)
    assert (error.value.status_code, error.value.param) == (400, "structured_outputs")


@pytest.mark.parametrize(
    "fields, shown",
    [
        ({}, "unset"),
        ({"reasoning_effort": "high"}, "high"),
        ({"reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "low"}}, "low"),
        ({"chat_template_kwargs": {"reasoning_effort": "minimal"}}, "minimal"),
    ],
)
def test_reasoning_effort_is_the_templates_variable(fields, shown):
    """vLLM passes the chat request's `reasoning_effort` to the template as a variable of that name
    (gpt-oss's template reads it); chat_template_kwargs, the request's explicit variables, win."""

    class Tokenizer:
        def apply_chat_template(self, chat, chat_template, tools, tokenize, **variables):
            return jinja2.Template(chat_template).render(messages=chat, **variables)

    template = "{{ reasoning_effort | default('unset') }}"
    state = SimpleNamespace(
        engine=SimpleNamespace(tokenizer=Tokenizer()),
        trust_request_chat_template=False,
        chat_template=template,
        chat_template_content_format="auto",
    )
    assert render_chat(state, request(**fields)) == shown


# -- auto tool choice at start: on by default where the model's family has a known parser ----------


@pytest.mark.parametrize(
    ("flags", "model_type", "auto", "parser"),
    [
        ((), "qwen3", True, "hermes"),  # the family's parser, no flag needed
        ((), "mistral", True, "mistral"),
        (("--tool-call-parser", "none"), "qwen3", False, None),  # turned off
        ((), "gpt2", False, None),  # no known parser: off, as before
        ((), None, False, None),  # the embedded model, GGUF files
        # vLLM's flags as before
        (("--enable-auto-tool-choice",), "qwen2", True, "hermes"),
        (("--enable-auto-tool-choice", "--tool-call-parser", "mistral"), "qwen3", True, "mistral"),
        (("--tool-call-parser", "hermes"), "qwen3", False, "hermes"),  # named alone: forced calls only
        (("--tool-call-parser", "hermes"), None, False, "hermes"),
    ],
)
def test_auto_tool_choice_at_start(tmp_path, flags, model_type, auto, parser):
    model = None
    if model_type is not None:
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
        model = str(tmp_path)
    setting = auto_tool_choice(_args(*flags, model=model))
    assert (setting.enable_auto_tool_choice, setting.tool_call_parser) == (auto, parser)
    line = setting.log_line()
    assert line.startswith(f"auto tool choice {'on, parser ' + parser if auto else 'off'}"), line
    if auto and not flags:
        assert "by default" in line and "--tool-call-parser none" in line
    options = tool_options(_args(*flags, model=model))
    assert options["enable_auto_tool_choice"] is auto
    assert options["tool_parser_cls"] is (None if parser is None else get_tool_parser(parser))


def test_tool_call_parser_none_with_the_auto_flag_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="--tool-call-parser none turns it off"):
        auto_tool_choice(_args("--enable-auto-tool-choice", "--tool-call-parser", "none"))
