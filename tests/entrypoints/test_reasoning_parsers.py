"""Reasoning parsers on scripted outputs: the split one-shot, streamed at every split, and where the
thinking starts as the prompt's ids say."""

from __future__ import annotations

import pytest

from xlaserve.entrypoints.serving.reasoning import REASONING_PARSERS, get_reasoning_parser

# (parser, output, reasoning, content), with the family's default start (the prompt unknown)
CASES = [
    (
        "deepseek_r1",
        "Let me think.\n2+2 is 4.\n</think>\n\nThe answer is 4.",
        "Let me think.\n2+2 is 4.\n",
        "The answer is 4.",
    ),
    ("deepseek_r1", "<think>hmm</think>4", "hmm", "4"),
    ("deepseek_r1", "cut off while thin", "cut off while thin", None),  # no end: all thinking
    ("deepseek_r1", "</think>", None, None),
    ("qwen3", "<think>\nThe user greets me.\n</think>\n\nHello!", "\nThe user greets me.\n", "Hello!"),
    ("qwen3", "Hello! No thinking here.", None, "Hello! No thinking here."),
    ("qwen3", "\n<think>a < b</thi</think>yes", "a < b</thi", "yes"),
    ("qwen3", "<think>never closed", "never closed", None),
    ("qwen3", "<thin", None, "<thin"),
]


class FakeTokenizer:
    def get_vocab(self):
        return {"<think>": 10, "</think>": 11, "a": 1, "b": 2}


def _streamed(parser, chunks):
    reasoning = content = ""
    text = ""
    deltas = []
    for chunk in chunks:
        previous, text = text, text + chunk
        deltas.append(parser.extract_reasoning_streaming(previous, text, chunk))
    deltas.append(parser.finish_streaming(text))
    for delta in deltas:
        if delta is not None:
            reasoning += delta.reasoning or ""
            content += delta.content or ""
    return reasoning or None, content or None


@pytest.mark.parametrize(("name", "output", "reasoning", "content"), CASES)
def test_split(name, output, reasoning, content):
    cls = get_reasoning_parser(name)
    assert cls().extract_reasoning(output) == (reasoning, content)
    for cut in range(len(output) + 1):
        assert _streamed(cls(), [output[:cut], output[cut:]]) == (reasoning, content), cut
    assert _streamed(cls(), list(output)) == (reasoning, content)


def test_stream_holds_a_possible_end_tag():
    parser = get_reasoning_parser("deepseek_r1")()
    assert parser.extract_reasoning_streaming("", "abc</th", "abc</th").reasoning == "abc"
    assert parser.extract_reasoning_streaming("abc</th", "abc</think", "ink") is None
    delta = parser.extract_reasoning_streaming("abc</think", "abc</think>\nok", ">\nok")
    assert (delta.reasoning, delta.content) == (None, "ok")


def test_prompt_decides_where_thinking_starts():
    cls = get_reasoning_parser("qwen3")
    tok = FakeTokenizer()
    # the template opened the thinking (Qwen3 2507 Thinking): no <think> in the output
    assert cls(tok, prompt_token_ids=[1, 10, 2]).extract_reasoning("x</think>y") == ("x", "y")
    # enable_thinking=false: the prompt closed it; the output is all answer
    assert cls(tok, prompt_token_ids=[1, 10, 11, 2]).extract_reasoning("x</think>y") == (None, "x</think>y")
    # deepseek_r1 with a prompt that says nothing: open by default
    assert get_reasoning_parser("deepseek_r1")(tok, prompt_token_ids=[1, 2]).extract_reasoning("x") == (
        "x",
        None,
    )


def test_is_reasoning_end():
    parser = get_reasoning_parser("qwen3")(FakeTokenizer())
    assert (parser.start_token_id, parser.end_token_id) == (10, 11)
    assert not parser.is_reasoning_end([1, 10, 2])
    assert parser.is_reasoning_end([1, 10, 2, 11])
    assert parser.is_reasoning_end([11, 2])
    assert not parser.is_reasoning_end([10, 11, 10, 2])  # a new thought opened after the last end
    assert not parser.is_reasoning_end([])


def test_tokenizer_without_tags_is_refused():
    class Plain:
        def get_vocab(self):
            return {"a": 0}

    with pytest.raises(ValueError, match="needs '</think>' as one token"):
        get_reasoning_parser("deepseek_r1")(Plain())


def test_registry():
    assert {"deepseek_r1", "qwen3"} <= set(REASONING_PARSERS)
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        get_reasoning_parser("nope")
