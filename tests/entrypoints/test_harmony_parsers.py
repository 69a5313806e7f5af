"""gpt-oss's harmony format through its parsers (`--reasoning-parser openai_gptoss`, `--tool-call-parser
openai`), on the texts the model writes (its special tokens kept): the thinking, the answer and the calls
one-shot, and the same streamed at every split and token by token.
"""

from __future__ import annotations

import json

import pytest

from xlaserve.entrypoints.serving.chat_parsing import ChoiceParser
from xlaserve.entrypoints.serving.harmony import read_messages
from xlaserve.entrypoints.serving.reasoning import get_reasoning_parser
from xlaserve.entrypoints.serving.tool_parsers import default_tool_parser, get_tool_parser

THOUGHT = "The user wants the weather. Call the tool."
ANALYSIS = f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
WEATHER_CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}'
)
# (output, reasoning, content, [(name, arguments)]); <|call|> and <|return|> are stop tokens, so an
# output usually ends without them.
CASES = [
    (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sunny.", THOUGHT, "It is sunny.", []),
    (ANALYSIS + WEATHER_CALL, THOUGHT, None, [("get_weather", {"city": "Paris"})]),
    (ANALYSIS + WEATHER_CALL + "<|call|>", THOUGHT, None, [("get_weather", {"city": "Paris"})]),
    # The recipient before the channel, and two calls with a preamble.
    (
        "<|channel|>commentary<|message|>Checking both.<|end|>"
        '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone": "CET"}<|end|>'
        + WEATHER_CALL,
        None,
        "Checking both.",
        [("get_time", {"zone": "CET"}), ("get_weather", {"city": "Paris"})],
    ),
    ("<|channel|>final<|message|>Hi!<|return|>", None, "Hi!", []),
    ("No format at all.", None, "No format at all.", []),
    ("<|channel|>analysis<|message|>cut while thin", "cut while thin", None, []),  # all thinking
    (ANALYSIS + "<|start|>assistant<|channel|>fin", THOUGHT, None, []),  # cut inside a header: markup only
]


class FakeTokenizer:
    def get_vocab(self):
        return {"<|channel|>": 5, "<|message|>": 6, "<|start|>": 7}

    def encode(self, text, add_special_tokens=False):
        return [{"final": 2}[text]]


def _parsers():
    reasoning = get_reasoning_parser("openai_gptoss")(FakeTokenizer())
    return ChoiceParser(reasoning, get_tool_parser("openai")())


def _calls(tool_calls):
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_one_shot_and_streamed_at_every_split(case):
    output, reasoning, content, calls = CASES[case]
    parsed = _parsers().parse(output)
    assert (parsed.reasoning, parsed.content, _calls(parsed.tool_calls)) == (reasoning, content, calls)
    for cut in range(len(output) + 1):
        assert _streamed(_parsers(), [output[:cut], output[cut:]]) == (reasoning, content, calls), cut


def test_streamed_token_by_token():
    """The markers arrive whole (special tokens), the rest in pieces: the call is announced once, its
    arguments grow, the thinking streams before it."""
    pieces = ["<|channel|>", "analysis", "<|message|>", "The user", " wants", "<|end|>", "<|start|>",
              "assistant", "<|channel|>", "commentary to", "=functions.get_weather ", "<|constrain|>", "json",
              "<|message|>", '{"city"', ': "Par', 'is"}']  # fmt: skip
    parser = _parsers()
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    assert "".join(d.reasoning or "" for d in deltas) == "The user wants"
    first = [d for d in deltas if d.tool_calls]
    assert first[0].tool_calls[0].function.name == "get_weather" and first[0].tool_calls[0].id
    arguments = "".join(c.function.arguments or "" for d in deltas for c in d.tool_calls)
    assert json.loads(arguments) == {"city": "Paris"}
    assert all(d.content is None for d in deltas)


def test_without_a_tool_parser_a_call_is_its_markup():
    reasoning = get_reasoning_parser("openai_gptoss")()
    assert reasoning.extract_reasoning(ANALYSIS + WEATHER_CALL) == (THOUGHT, WEATHER_CALL)


def test_without_a_reasoning_parser_the_thinking_is_not_content():
    extracted = get_tool_parser("openai")().extract_tool_calls(ANALYSIS + "<|channel|>final<|message|>Done.")
    assert (extracted.content, extracted.tool_calls) == ("Done.", [])


def test_messages():
    messages, is_held = read_messages(ANALYSIS + WEATHER_CALL, final=False)
    assert [(m.channel, m.function_name, m.is_closed) for m in messages] == [
        ("analysis", None, True),
        ("commentary", "get_weather", False),
    ]
    assert not is_held
    assert read_messages(ANALYSIS + "<|start|>assistant<|chan", final=False)[1]  # a header: held back
    [plain], is_held = read_messages("It is <|", final=False)  # maybe a marker: held back
    assert (plain.channel, plain.body, is_held) == (None, "It is ", True)


def test_reasoning_end_and_registry():
    class Tokenizer(FakeTokenizer):
        def decode(self, ids, skip_special_tokens=False):
            return "".join({5: "<|channel|>", 6: "<|message|>", 7: "<|start|>", 1: "assistant", 2: "final",
                            3: "analysis", 4: "x"}[i] for i in ids)  # fmt: skip

    parser = get_reasoning_parser("openai_gptoss")(Tokenizer())
    prompt = [7, 1, 5, 2, 6, 4, 7, 1]  # an earlier turn's final answer, then <|start|>assistant
    assert not parser.is_reasoning_end(prompt)
    assert not parser.is_reasoning_end(prompt + [5, 3, 6, 4])
    assert parser.is_reasoning_end(prompt + [5, 3, 6, 4, 7, 1, 5, 2, 6])
    # Structured output starts after the final channel's header: `<|channel|>final`, then `<|message|>`.
    assert (parser.end_prefix_ids, parser.end_token_id) == ([5, 2], 6)
    assert parser.keeps_special_tokens and get_tool_parser("openai").keeps_special_tokens
    assert default_tool_parser({"model_type": "gpt_oss"}) == "openai"
    with pytest.raises(ValueError, match="<\\|channel\\|>"):
        get_reasoning_parser("openai_gptoss")(type("T", (), {"get_vocab": lambda self: {}})())


def _streamed(parser, chunks):
    deltas = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
    reasoning = "".join(d.reasoning or "" for d in deltas) or None
    content = "".join(d.content or "" for d in deltas) or None
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        for call in delta.tool_calls:
            entry = calls.setdefault(call.index, ["", ""])
            entry[0] += call.function.name or ""
            entry[1] += call.function.arguments or ""
    return reasoning, content, [(name, json.loads(args)) for name, args in (calls[i] for i in sorted(calls))]
