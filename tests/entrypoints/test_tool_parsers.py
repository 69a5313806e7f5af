"""Tool-call parsers on outputs in each format: one-shot parses, and streams of the same text split at
every position, which must give the same calls and content."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from xlaserve.entrypoints.serving.tool_parsers import (
    TOOL_PARSERS,
    NamedToolParser,
    RequiredToolParser,
    default_tool_parser,
    get_tool_parser,
)
from xlaserve.entrypoints.serving.tool_parsers.json_scan import ObjectScanner, Status, scan_object

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
# The XML formats' typed values (by REQUEST's schema below), the city aside.
TYPED_VALUES = {"days": 3, "metric": True, "temp": 21, "opts": {"h": [1, 2]}, "note": None, "extra": "7"}
# (parser, model output, expected content, expected [(name, arguments as a dict)])
CASES = [
    # Qwen2.5's format, as its chat template describes it
    (
        "hermes",
        f"<tool_call>\n{WEATHER}\n</tool_call>",
        None,
        [("get_weather", {"city": "Paris", "unit": "celsius"})],
    ),
    (
        "hermes",
        "I will check both.\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": '
        '{"tz": "Europe/Paris", "fmt": [1, 2.5e-3, true, null]}}\n</tool_call>',
        "I will check both.",
        [
            ("get_weather", {"city": "Paris"}),
            ("get_time", {"tz": "Europe/Paris", "fmt": [1, 2.5e-3, True, None]}),
        ],
    ),
    ("hermes", "The answer is 4.", "The answer is 4.", []),
    ("hermes", "Use <tool_ in HTML? No: 3 < 4.", "Use <tool_ in HTML? No: 3 < 4.", []),
    # no end tag (the model stopped at EOS right after the object), arguments as a JSON string
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}', None, [("f", {"x": 1})]),
    (
        "hermes",
        '<tool_call>{"arguments": {"q": "a \\"quoted\\" \\u00e9"}, "name": "search"}</tool_call>',
        None,
        [("search", {"q": 'a "quoted" \u00e9'})],
    ),
    ("hermes", '<tool_call>{"name": "noargs"}</tool_call>', None, [("noargs", {})]),
    # not a call: no name, not JSON, arguments not an object -> content
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("hermes", "<tool_call> call get_weather please", "<tool_call> call get_weather please", []),
    (
        "hermes",
        '<tool_call>{"name": "f", "arguments": 3}</tool_call>',
        '<tool_call>{"name": "f", "arguments": 3}</tool_call>',
        [],
    ),
    # content around calls: the whitespace before a call is the call's, the whitespace that separates
    # content resuming after a call stays (and is dropped where no content came before or none follows)
    ("mistral", 'Sure.\n\n[TOOL_CALLS]a[ARGS]{"x": 1}\n', "Sure.", [("a", {"x": 1})]),
    (
        "hermes",
        f"First Paris.\n\n<tool_call>\n{WEATHER}\n</tool_call>\n Then Rome: \n<tool_call>"
        '{"name": "f", "arguments": {}}</tool_call>\n\n',
        "First Paris.\n Then Rome:",
        [("get_weather", {"city": "Paris", "unit": "celsius"}), ("f", {})],
    ),
    (
        "qwen3_coder",
        "Let me check.\n<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n"
        "</tool_call>\n\nDone.",
        "Let me check.\n\nDone.",
        [("f", {"x": "1"})],
    ),
    (
        "hermes",
        f"<tool_call>{WEATHER}</tool_call>\n Done.\n",
        "Done.\n",
        [("get_weather", {"city": "Paris", "unit": "celsius"})],
    ),
    # Llama 3.1's JSON format
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
        None,
        [("a", {"x": 1}), ("b", {})],
    ),
    ("llama3_json", "Paris is the capital of France.", "Paris is the capital of France.", []),
    ("llama3_json", '{"city": "Paris"}', '{"city": "Paris"}', []),
    (
        "llama3_json",
        '  {"type": "function", "name": "f", "parameters": {"a": {"b": []}}}',
        None,
        [("f", {"a": {"b": []}})],
    ),
    # Mistral's two forms
    ("mistral", f"[TOOL_CALLS] [{WEATHER}]", None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    (
        "mistral",
        'Sure. [TOOL_CALLS][{"name": "a", "arguments": {"x": [1]}}, {"name": "b", "arguments": {}}]',
        "Sure.",
        [("a", {"x": [1]}), ("b", {})],
    ),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None, [("get_weather", {"city": "Paris"})]),
    ("mistral", '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}', None, [("a", {"x": 1}), ("b", {})]),
    ("mistral", "No tools needed.", "No tools needed.", []),
    ("mistral", "[TOOL_CALLS] oops", "[TOOL_CALLS] oops", []),
    # SmolLM2's form: a list inside the hermes tags
    (
        "hermes",
        '<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]</tool_call>',
        None,
        [("a", {"x": 1}), ("b", {})],
    ),
    # what a grammar forces for tool_choice named ("named:FUNCTION") and "required"
    (
        "named:get_weather",
        '{"city": "Paris", "days": 3}',
        None,
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    ("named:f", "  {}", None, [("f", {})]),
    (
        "required",
        '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"y": [true]}}]',
        None,
        [("a", {"x": 1}), ("b", {"y": [True]})],
    ),
    ("required", "[]", "[]", []),
    # Qwen3-Coder's XML: values typed by REQUEST's schema (a string, an int that is not one, an
    # untyped parameter, a list of types), a bare <function=...>, a </function> cut off at the end
    (
        "qwen3_coder",
        "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=temp>\n"
        '21.0\n</parameter>\n<parameter=opts>\n{"h": [1, 2]}\n</parameter>\n<parameter=note>\nnull\n'
        "</parameter>\n<parameter=extra>\n7\n</parameter>\n</function>\n</tool_call>",
        "Let me check.",
        [
            (
                "get_weather",
                {"city": "Paris", **TYPED_VALUES},
            )
        ],
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n<parameter=temp>\n"
        "-1.5\n</parameter>\n<parameter=span>\n[1, 2]\n</parameter>\n</function>\n</tool_call>\n"
        "<function=run>\n<parameter=code>\ndef f():\n    return '<a>'\n\n</parameter>\n"
        "<parameter=x>\n1",
        None,
        [
            ("get_weather", {"days": "three", "temp": -1.5, "span": [1, 2]}),
            ("run", {"code": "def f():\n    return '<a>'\n", "x": "1"}),
        ],
    ),
    (
        "qwen3_coder",
        "<tool_call><function=a><parameter=x>1</parameter></function>"
        "<function=get_weather><parameter=days>2</parameter></function></tool_call>",
        None,
        [("a", {"x": "1"}), ("get_weather", {"days": 2})],
    ),
    (
        "qwen3_coder",
        '<tool_call>\n{"name": "f"}\n</tool_call>',
        '<tool_call>\n{"name": "f"}\n</tool_call>',
        [],
    ),
    ("qwen3_coder", "a <b> c <function=bad name\n>", "a <b> c <function=bad name\n>", []),
    # MiniMax-M2's XML: quoted or bare names, values typed by REQUEST's schema as vLLM's parser types them
    # (an untyped parameter and an unknown tool's are strings; anyOf, enum; what no type takes is JSON
    # or text, a non-finite number text), a call without parameters, the block's end cut off at the end
    (
        "minimax_m2",
        'Let me check.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">San '
        'Francisco</parameter>\n<parameter name="days"> 3\n</parameter>\n<parameter name="metric">yes'
        '</parameter>\n<parameter name="temp">21.0</parameter>\n<parameter name="opts">{"h": [1, 2]}'
        '</parameter>\n<parameter name="note">None</parameter>\n<parameter name="extra">7</parameter>\n'
        "</invoke>\n<invoke name='get_time'>\n<parameter name='tz'>9</parameter>\n</invoke>\n"
        "</minimax:tool_call>",
        "Let me check.",
        [
            (
                "get_weather",
                {"city": "San Francisco", **TYPED_VALUES},
            ),
            ("get_time", {"tz": "9"}),
        ],
    ),
    (
        "minimax_m2",
        "<minimax:tool_call><invoke name=get_weather><parameter name=mode>12</parameter><parameter "
        'name="level">2</parameter><parameter name="temp">1e999</parameter><parameter name="days">three'
        '</parameter><parameter name="span">[1, NaN]</parameter><parameter name="metric">off</parameter>'
        '</invoke></minimax:tool_call> Done. <minimax:tool_call><invoke name="f"></invoke>',
        "Done.",
        [
            (
                "get_weather",
                {
                    "mode": 12,
                    "level": 2,
                    "temp": "1e999",
                    "days": "three",
                    "span": "[1, NaN]",
                    "metric": False,
                },
            ),
            ("f", {}),
        ],
    ),
    (
        "minimax_m2",
        '<minimax:tool_call>\n{"name": "f"}\n</minimax:tool_call>',
        '<minimax:tool_call>\n{"name": "f"}\n</minimax:tool_call>',
        [],
    ),
    (
        "minimax_m2",
        'a < b <minimax:tool_call><invoke name="bad\nname"></invoke><minimax:tool_call></minimax:tool_call>',
        'a < b <minimax:tool_call><invoke name="bad\nname"></invoke><minimax:tool_call></minimax:tool_call>',
        [],
    ),
    # Llama 3.2 / Llama 4's Python list of calls
    (
        "pythonic",
        "[get_weather(city=\"Paris\", days=3), get_time(tz='Europe/Paris', "
        'opts={"h24": True, "n": [1, -2.5e-3, None], "s": "a, b) c"})]',
        None,
        [
            ("get_weather", {"city": "Paris", "days": 3}),
            (
                "get_time",
                {"tz": "Europe/Paris", "opts": {"h24": True, "n": [1, -2.5e-3, None], "s": "a, b) c"}},
            ),
        ],
    ),
    ("pythonic", "[f()]", None, [("f", {})]),
    ("pythonic", "The list is [1, 2].", "The list is [1, 2].", []),
    ("pythonic", "[1, 2]", "[1, 2]", []),
    ("pythonic", "[f(x)]", "[f(x)]", []),
    # a value that is not a literal, in any call, makes the list content, streamed too (nothing went out)
    ("pythonic", "[get_weather(city=foo)]", "[get_weather(city=foo)]", []),
    (
        "pythonic",
        '[f(a="x"), get_weather(city="Paris", days=x)]',
        '[f(a="x"), get_weather(city="Paris", days=x)]',
        [],
    ),
    ("pythonic", "[f(a=1, b=g())]", "[f(a=1, b=g())]", []),
    ("pythonic", "[f(a=1, a=2)]", "[f(a=1, a=2)]", []),  # a keyword twice is not Python (nor one object)
    # DeepSeek-V3's and V3.1's special-token blocks
    (
        "deepseek_v3",
        "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
        '```json\n{"tz": "UTC", "f": [1]}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "Sure.",
        [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC", "f": [1]})],
    ),
    ("deepseek_v3", "<｜tool▁calls▁begin｜>oops", "<｜tool▁calls▁begin｜>oops", []),
    (
        "deepseek_v31",
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
        "<｜tool▁call▁end｜>"
        "<｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜> Done.",
        "Done.",
        [("get_weather", {"city": "Paris"}), ("f", {})],
    ),
    ("deepseek_v31", "No tools: 2 < 3.", "No tools: 2 < 3.", []),
    # Granite 3.0's special token, Granite 3.1's text tag
    (
        "granite",
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "granite",
        '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]',
        None,
        [("a", {}), ("b", {"x": 1})],
    ),
    ("granite", "Hello [there]", "Hello [there]", []),
    # Phi-4-mini's list after `functools`, after text; the word alone (or before no list) is content
    (
        "phi4_mini_json",
        'Let me check.\nfunctools[{"name": "get_weather", "arguments": {"city": "Paris", "note": "functools[]'
        '\\" ]"}}, {"name": "get_time", "parameters": {"f": [1, {"a": null}]}}] Done.',
        "Let me check. Done.",
        [("get_weather", {"city": "Paris", "note": 'functools[]" ]'}), ("get_time", {"f": [1, {"a": None}]})],
    ),
    ("phi4_mini_json", 'functools[{"name": "f", "arguments": {}}]', None, [("f", {})]),
    ("phi4_mini_json", "Use functools[0] or functools.reduce", "Use functools[0] or functools.reduce", []),
    ("phi4_mini_json", "functools[]", "functools[]", []),
    # Llama 4's pythonic list, between its tags or bare; only at the start of the answer, as in vLLM
    (
        "llama4_pythonic",
        '<|python_start|>[get_weather(city="Paris <|python_end|>]", days=3), '
        'get_time(opts={"n": [1, {"a": None}], "s": "f(x)"})]<|python_end|>',
        None,
        [
            ("get_weather", {"city": "Paris <|python_end|>]", "days": 3}),
            ("get_time", {"opts": {"n": [1, {"a": None}], "s": "f(x)"}}),
        ],
    ),
    ("llama4_pythonic", "[f(a=-1)] Done.", "Done.", [("f", {"a": -1})]),
    (
        "llama4_pythonic",
        '<|python_start|>[f(a=1), g(b="x" + "y")]<|python_end|>',
        '<|python_start|>[f(a=1), g(b="x" + "y")]<|python_end|>',
        [],
    ),
    ("llama4_pythonic", "Hi <|python_start|>[f()]", "Hi <|python_start|>[f()]", []),
    (
        "llama4_pythonic",
        "<|python_start|>print(1)<|python_end|>",
        "<|python_start|>print(1)<|python_end|>",
        [],
    ),
    # OLMo 3's lines of calls between tags, after text, JSON's names as values, a missing end tag at the end
    (
        "olmo3",
        "I will look.\n<function_calls>get_weather(city='Paris </function_calls>\\'', days=3)\n"
        'get_time(opts={"n": [1, null], "ok": true}, tz=None)</function_calls>\nDone.',
        "I will look.\nDone.",
        [
            ("get_weather", {"city": "Paris </function_calls>'", "days": 3}),
            ("get_time", {"opts": {"n": [1, None], "ok": True}, "tz": None}),
        ],
    ),
    ("olmo3", "<function_calls>\nf(x=[1, 2]), g()\n", None, [("f", {"x": [1, 2]}), ("g", {})]),
    ("olmo3", "<function_calls>f(x)</function_calls>", "<function_calls>f(x)</function_calls>", []),
    # a positional first call makes the block text (vLLM's pattern check); a later one is skipped
    (
        "olmo3",
        "<function_calls>f(x)\ng(a=1)</function_calls>",
        "<function_calls>f(x)\ng(a=1)</function_calls>",
        [],
    ),
    ("olmo3", "<function_calls>g(a=1)\nf(1)</function_calls>", None, [("g", {"a": 1})]),
    ("olmo3", "No calls: a < b <function_calls", "No calls: a < b <function_calls", []),
    # a bad value skips its call, the end of the text cuts one off: the whole calls stand, streamed too
    (
        "olmo3",
        "Hi\n<function_calls>get_weather(city=foo)\nget_time(tz='UTC', n=[1, x])\nf(a=1)</function_calls>",
        "Hi",
        [("f", {"a": 1})],
    ),
    ("olmo3", "Hi <function_calls>g(x=2)\nf(a='Par", "Hi", [("g", {"x": 2})]),
    ("olmo3", "<function_calls>f(a='Par", "<function_calls>f(a='Par", []),
    # GLM-4.5's keys and values: a "string" parameter kept exactly ("null", spaces), any other read as
    # JSON or a Python literal (an untyped one too), else text; GLM-4.7's name straight before its first
    # key; a call without arguments; a key without a value skipped; a call cut off at the end
    (
        "glm45",
        "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value> Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>metric</arg_key>\n<arg_value>True"
        "</arg_value>\n<arg_key>temp</arg_key><arg_value>-1.5</arg_value><arg_key>opts</arg_key>"
        '<arg_value>{"h": [1, 2]}</arg_value><arg_key>note</arg_key><arg_value>null</arg_value>'
        "<arg_key>extra</arg_key><arg_value> 7\n</arg_value><arg_key>word</arg_key><arg_value>seven"
        "</arg_value>\n</tool_call>",
        "Let me check.",
        [
            (
                "get_weather",
                {
                    "city": " Paris",
                    "days": 3,
                    "metric": True,
                    "temp": -1.5,
                    "opts": {"h": [1, 2]},
                    "note": "null",
                    "extra": 7,
                    "word": "seven",
                },
            )
        ],
    ),
    (
        "glm45",
        "<tool_call>run<arg_key>code</arg_key><arg_value>print('<a>')\n</arg_value><arg_key>lone"
        "</arg_key>x<arg_key>n</arg_key><arg_value>[1, None]</arg_value></tool_call>\nthen\n"
        "<tool_call>get_time\n</tool_call><tool_call>get_weather\n<arg_key>city</arg_key><arg_value>Par",
        "then",
        [
            ("run", {"code": "print('<a>')", "n": [1, None]}),
            ("get_time", {}),
            ("get_weather", {"city": "Par"}),
        ],
    ),
    # not this format's calls: JSON (Hermes'), a name with a space, no name; a partial tag at the end
    (
        "glm45",
        '<tool_call>\n{"name": "f"}\n</tool_call> <tool_call>bad name\n</tool_call>'
        "<tool_call>\n</tool_call> <tool_c",
        '<tool_call>\n{"name": "f"}\n</tool_call> <tool_call>bad name\n</tool_call>'
        "<tool_call>\n</tool_call> <tool_c",
        [],
    ),
    # a literal with no JSON form stays text: a non-finite number, a set
    (
        "glm45",
        "<tool_call>f\n<arg_key>a</arg_key><arg_value>Infinity</arg_value><arg_key>b</arg_key>"
        "<arg_value>{1, 2}</arg_value><arg_key>c</arg_key><arg_value>1e999</arg_value></tool_call>",
        None,
        [("f", {"a": "Infinity", "b": "{1, 2}", "c": "1e999"})],
    ),
]
# The request the outputs answer: qwen3_coder and glm45 type their values by these schemas; the others
# ignore it.
_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "metric": {"type": "boolean"},
        "temp": {"type": "number"},
        "opts": {"type": "object"},
        "note": {"type": "string"},
        "span": {"type": ["array", "null"]},
        "mode": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "level": {"enum": [1, 2, "max"]},
    },
}
REQUEST = SimpleNamespace(
    tools=[
        SimpleNamespace(type="function", function=SimpleNamespace(name="get_weather", parameters=_SCHEMA))
    ],
    parallel_tool_calls=None,
)


def make_parser(name: str):
    if name.startswith("named:"):
        return NamedToolParser(name.split(":", 1)[1])
    return RequiredToolParser() if name == "required" else get_tool_parser(name)()


def _streamed(parser_name: str, chunks: list[str]):
    parser = make_parser(parser_name)
    content, calls, text = "", {}, ""
    deltas = []
    for chunk in chunks:
        previous, text = text, text + chunk
        deltas.append(parser.extract_tool_calls_streaming(previous, text, chunk, REQUEST))
    deltas.append(parser.finish_streaming(text, REQUEST))
    for delta in deltas:
        if delta is None:
            continue
        content += delta.content or ""
        for tc in delta.tool_calls:
            if tc.index not in calls:
                assert tc.index == len(calls), "calls are announced in order"
                assert tc.id and tc.function.name and tc.type == "function"
                calls[tc.index] = [tc.function.name, ""]
            else:
                assert tc.id is None and tc.function.name is None, "id and name come once"
            calls[tc.index][1] += tc.function.arguments or ""
    return content or None, [(name, args) for name, args in calls.values()]


def _argument_pieces(parser_name: str, text: str) -> list[str]:
    """The arguments' pieces the deltas carry, `text` streamed a character at a time."""
    parser = get_tool_parser(parser_name)()
    pieces = []
    for i in range(1, len(text) + 1):
        delta = parser.extract_tool_calls_streaming(text[: i - 1], text[:i], text[i - 1], REQUEST)
        pieces += [tc.function.arguments for tc in (delta.tool_calls if delta else [])]
    return pieces


@pytest.mark.parametrize(("parser_name", "output", "content", "calls"), CASES)
def test_one_shot(parser_name, output, content, calls):
    result = make_parser(parser_name).extract_tool_calls(output, REQUEST)
    assert result.content == content
    assert result.tools_called == bool(calls)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in result.tool_calls] == calls
    assert len({c.id for c in result.tool_calls}) == len(calls)


@pytest.mark.parametrize(("parser_name", "output", "content", "calls"), CASES)
def test_stream_split_anywhere_matches_one_shot(parser_name, output, content, calls):
    one_shot = make_parser(parser_name).extract_tool_calls(output, REQUEST)
    expected = (one_shot.content, [(c.function.name, c.function.arguments) for c in one_shot.tool_calls])
    assert _streamed(parser_name, list(output)) == expected  # one character at a time
    for cut in range(len(output) + 1):  # every two-piece split
        assert _streamed(parser_name, [output[:cut], output[cut:]]) == expected, cut
    rng = random.Random(len(output))
    for _ in range(5):  # token-like pieces
        cuts = sorted(rng.sample(range(1, len(output)), min(len(output) - 1, len(output) // 4)))
        chunks = [output[a:b] for a, b in zip([0, *cuts], [*cuts, len(output)])]
        assert _streamed(parser_name, chunks) == expected


def test_stream_holds_a_possible_start_tag():
    parser = get_tool_parser("hermes")()
    assert parser.extract_tool_calls_streaming("", "Hi <tool", "Hi <tool").content == "Hi"
    assert parser.extract_tool_calls_streaming("Hi <tool", "Hi <tool_ca", "_ca") is None
    delta = parser.extract_tool_calls_streaming("Hi <tool_ca", "Hi <tool_cat", "t")
    assert delta.content == " <tool_cat"  # decided: not a tag


def test_arguments_stream_in_pieces():
    pieces = _argument_pieces("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>")
    assert len(pieces) > 10 and "".join(pieces) == '{"city": "Paris", "unit": "celsius"}'


def test_broken_call_after_announcement_keeps_stream_whole():
    """Bad JSON inside the arguments after the call went out: the stream keeps what it sent and the
    rest comes back as content; the one-shot parse returns it all as content."""
    text = '<tool_call>{"name": "f", "arguments": {"a": 1 oops}}</tool_call>'
    content, calls = _streamed("hermes", list(text))
    assert calls == [("f", '{"a": 1 ')]  # what went out before the break
    assert content == "oops}}</tool_call>"
    assert get_tool_parser("hermes")().extract_tool_calls(text).content == text


def test_xml_and_pythonic_arguments_are_json_dumps_text():
    """qwen3_coder's and pythonic's arguments are built, not copied: the text is json.dumps' of the
    values (what vLLM sends), whichever way the stream was cut."""
    for name, output, _, calls in CASES:
        if name not in ("qwen3_coder", "pythonic", "llama4_pythonic", "olmo3", "glm45"):
            continue
        result = get_tool_parser(name)().extract_tool_calls(output, REQUEST)
        assert [c.function.arguments for c in result.tool_calls] == [
            json.dumps(args, ensure_ascii=False) for _, args in calls
        ]


@pytest.mark.parametrize(
    ("parser_name", "text", "first_pieces"),
    [
        (
            "qwen3_coder",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
            "<parameter=days>\n12\n</parameter>\n</function>\n</tool_call>",
            ["{", '"city": "S', "a"],
        ),
        (  # a "string" value is never null for GLM-4.5: its quote goes out before its first character
            "glm45",
            "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>San Francisco</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>12</arg_value>\n</tool_call>",
            ["{", '"city": "', "S"],
        ),
    ],
)
def test_xml_string_values_stream_as_written(parser_name, text, first_pieces):
    """A string parameter (long code, a file's text) streams as it comes; a typed one waits for its end."""
    pieces = _argument_pieces(parser_name, text)
    assert pieces[:3] == first_pieces
    assert pieces[-3:] == ['"', ', "days": 12', "}"]
    assert "".join(pieces) == '{"city": "San Francisco", "days": 12}'


def test_bad_values_never_stream_a_call():
    """A call with a value that is not a literal (or cut off, olmo3) streams nothing: every call a client
    accumulates, however the text was cut, is JSON and one the one-shot parse returns too; pythonic's
    calls wait for the list's "]" (a later bad value makes the list content), olmo3's for their ")"."""
    for name, output, _, _ in CASES:
        if name not in ("pythonic", "llama4_pythonic", "olmo3"):
            continue
        one_shot = get_tool_parser(name)().extract_tool_calls(output, REQUEST).tool_calls
        expected = [(c.function.name, c.function.arguments) for c in one_shot]
        for cut in range(len(output) + 1):
            _, calls = _streamed(name, [output[:cut], output[cut:]])
            assert all(isinstance(json.loads(args), dict) for _, args in calls), (output, cut)
            assert calls == expected, (output, cut)
    text = "[get_weather(city='Paris', days=3), f(a=1"
    assert _argument_pieces("pythonic", text + ")]") == ['{"city": "Paris", "days": 3}', '{"a": 1}']
    assert _argument_pieces("pythonic", text) == []  # held until the list closes


def test_olmo3_skips_a_bad_call_and_keeps_the_others():
    """A call that is not literals (1e999 is inf, which JSON cannot write; a call as a value) is skipped
    and its siblings kept, as vLLM's newer parser salvages them: it leaves no trace, streamed or not. A
    block of bad calls only is text."""
    text = "Hi\n<function_calls>a(x=1e999)\nb(y=2)\nc(z=g(), w=1), d()</function_calls>\nBye"
    result = get_tool_parser("olmo3")().extract_tool_calls(text)
    expected = [("b", '{"y": 2}'), ("d", "{}")]
    assert [(c.function.name, c.function.arguments) for c in result.tool_calls] == expected
    assert result.content == "Hi\nBye"
    assert _streamed("olmo3", list(text)) == ("Hi\nBye", expected)
    assert _argument_pieces("olmo3", text) == ['{"y": 2}', "{}"]  # each whole, at its ")"
    text = "<function_calls>f(x=1e999)</function_calls>"
    assert get_tool_parser("olmo3")().extract_tool_calls(text).content == text
    assert _streamed("olmo3", list(text)) == (text, [])


def test_forced_call_cut_off():
    """max_tokens ended a forced call: one-shot it is content (not a call), streamed the call went out."""
    text = '{"city": "Par'
    result = NamedToolParser("f").extract_tool_calls(text)
    assert (result.tools_called, result.content) == (False, text)
    assert _streamed("named:f", list(text)) == (None, [("f", text)])


def test_parallel_tool_calls_false_keeps_the_first():
    class Req:
        parallel_tool_calls = False

    text = CASES[1][1]
    result = get_tool_parser("hermes")().extract_tool_calls(text, Req())
    assert [c.function.name for c in result.tool_calls] == ["get_weather"]


def test_registry_and_defaults():
    assert {"hermes", "llama3_json", "mistral", "qwen3_coder", "pythonic", "deepseek_v3", "deepseek_v31"} | {
        "granite",
        "phi4_mini_json",
        "llama4_pythonic",
        "olmo3",
        "glm45",
    } <= set(TOOL_PARSERS)
    # the server keeps special tokens in the text for parsers whose tags are special tokens
    names = ("llama4_pythonic", "olmo3", "phi4_mini_json", "glm45")
    keeps = {name: get_tool_parser(name).keeps_special_tokens for name in names}
    assert keeps == {"llama4_pythonic": True, "olmo3": False, "phi4_mini_json": False, "glm45": True}
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'"):
        get_tool_parser("nope")
    assert default_tool_parser("qwen2") == "hermes"
    assert default_tool_parser({"model_type": "llama"}) == "llama3_json"
    assert default_tool_parser({"model_type": "mistral"}) == "mistral"
    assert default_tool_parser({"model_type": "glm4_moe"}) == "glm45"
    assert default_tool_parser("gpt2") is None
    assert len(get_tool_parser("mistral")().new_call_id()) == 9


def test_json_scan_agrees_with_json_loads():
    rng = random.Random(0)

    def value(depth=0):
        r = rng.random()
        if depth > 3 or r < 0.3:
            return rng.choice([1, -2.5, 1e10, 0, "s", 'a"b\\c\u00e9\n', True, False, None, ""])
        if r < 0.6:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return {f"k{i}": value(depth + 1) for i in range(rng.randint(0, 3))}

    for _ in range(300):
        obj = {k: value() for k in rng.sample(["name", "arguments", "x"], rng.randint(0, 3))}
        text = json.dumps(obj, indent=rng.choice([None, 1]), ensure_ascii=rng.random() < 0.5)
        scan = scan_object(text + " tail", 0)
        assert scan.status is Status.COMPLETE and scan.end == len(text)
        assert {k: json.loads(text[m.start : m.end]) for k, m in scan.members.items()} == obj
        cuts = rng.sample(range(1, len(text)), min(len(text) - 1, 24))
        assert all(scan_object(text[:cut], 0).status is Status.PARTIAL for cut in cuts)
        i = rng.randrange(len(text))
        mutated = text[:i] + rng.choice('x,:"{}[]1 e-') + text[i + 1 :]
        resumed = ObjectScanner(0)  # fed a growing text, it answers as a fresh scan of each prefix
        for cut in sorted(rng.sample(range(1, len(mutated) + 1), min(len(mutated), 12))):
            fresh, again = scan_object(mutated[:cut], 0), resumed.scan(mutated[:cut])
            assert (again.status, again.end) == (fresh.status, fresh.end), mutated[:cut]
            spans = {k: (m.start, m.end) for k, m in fresh.members.items()}
            assert {k: (m.start, m.end) for k, m in again.members.items()} == spans
        scan = scan_object(mutated, 0)
        if scan.status is Status.INVALID:  # the break is the first character that cannot be JSON
            assert scan_object(mutated[: scan.end], 0).status is Status.PARTIAL
            with pytest.raises(ValueError):
                json.loads(mutated)
        elif scan.status is Status.COMPLETE:
            json.loads(mutated[: scan.end])


def test_minimax_m2_call_cut_or_broken_inside_its_invoke():
    """No </invoke> (max_tokens), or one inside a value before its </parameter>: one-shot the block is
    content (vLLM's), streamed the call keeps the parameters it sent and the rest is content."""
    cut = 'Hi <minimax:tool_call><invoke name="f"><parameter name="x">1</parameter><parameter name="y">2'
    broken = '<minimax:tool_call><invoke name="f"><parameter name="x">a</invoke>b</parameter></invoke>'
    for text, rest in [(cut, 'Hi<parameter name="y">2'), (broken, broken[36:])]:
        result = get_tool_parser("minimax_m2")().extract_tool_calls(text, REQUEST)
        assert (result.tools_called, result.content) == (False, text)
        expected_call = ("f", '{"x": "1"' if text == cut else "{")
        assert _streamed("minimax_m2", list(text)) == (rest, [expected_call])


def test_minimax_m2_arguments_are_json_dumps_text_growing_a_parameter_at_a_time():
    text = '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">San Francisco'
    text += '</parameter>\n<parameter name="days">12</parameter>\n</invoke>\n</minimax:tool_call>'
    pieces = _argument_pieces("minimax_m2", text)
    assert pieces == ["{", '"city": "San Francisco"', ', "days": 12', "}"]
    for name, output, _, calls in CASES:
        if name == "minimax_m2":
            result = get_tool_parser(name)().extract_tool_calls(output, REQUEST)
            assert [c.function.arguments for c in result.tool_calls] == [
                json.dumps(args, ensure_ascii=False) for _, args in calls
            ]
    assert default_tool_parser({"model_type": "minimax_m2"}) == "minimax_m2"


def test_minimax_m2_values_from_hostile_schemas_and_text():
    from xlaserve.entrypoints.serving.tool_parsers.minimax_m2 import convert_value

    deep: dict = {"type": "integer"}
    for _ in range(2000):  # nesting past the recursion limit: read to a depth, then a string
        deep = {"anyOf": [deep]}
    assert convert_value("7", deep) == "7"
    assert convert_value("7", {"anyOf": [{"anyOf": [{"type": "integer"}]}]}) == 7
    assert convert_value("[" * 100_000, {"type": "array"}) == "[" * 100_000
    assert convert_value("nil", {"type": "integer"}) is None
    assert convert_value("Infinity", {"type": "number"}) == "Infinity"
    assert convert_value("maybe", {"type": ["boolean", "null"]}) == "maybe"
    assert convert_value("1", {"type": 3, "enum": "x"}) == "1"  # not a schema's shapes: a string
    assert convert_value("3.5", {"enum": [None, 1.5]}) == 3.5
