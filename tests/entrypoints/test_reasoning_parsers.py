"""Reasoning parsers on scripted outputs: the split one-shot, streamed at every split, and where the
thinking starts as the prompt's ids say (or the request's chat_template_kwargs: `NAME+SWITCH` below is
the parser for a request with `{SWITCH: true}`)."""

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
    # DeepSeek-V3.1: thinking only when the request turns it on
    ("deepseek_v3", "<think>x</think>y", None, "<think>x</think>y"),
    ("deepseek_v3+thinking", "Let me think.</think>\n\nSure.", "Let me think.", "Sure."),
    ("deepseek_v3+enable_thinking", "cut off", "cut off", None),
    # Granite: plain-word markers, which a stream splits anywhere
    (
        "granite",
        "Here is my thought process:\nThe user greets me.\nHere is my response:\nHello!",
        "\nThe user greets me.\n",
        "Hello!",
    ),
    ("granite", "Here's my thought process: a Here is: b Here's my response: c", " a Here is: b ", "c"),
    (
        "granite",
        "Here is my thought process: a Here's my response: b Here is my response: c",
        " a ",
        "b Here is my response: c",
    ),
    ("granite", "Hi! Here is my response: no thoughts", None, "Hi! Here is my response: no thoughts"),
    ("granite", "Here is my thought process: cut off, Here is my", " cut off, Here is my", None),
    ("granite", "Here is my though", None, "Here is my though"),
    # Magistral: answer text may stand before [THINK]; a stray [/THINK] without one is dropped
    ("mistral", "[THINK]Paris is the capital.[/THINK]Paris.", "Paris is the capital.", "Paris."),
    ("mistral", "Sure. [THINK]a [/TH b[/THINK] Done", "a [/TH b", "Sure.  Done"),
    ("mistral", "no thinking [/THINK]here[/THINK]", None, "no thinking here[/THINK]"),
    ("mistral", "[THINK]never closed [/THIN", "never closed [/THIN", None),
    ("mistral", "[THINK", None, "[THINK"),
    # Olmo 3 Think: the template opened <think>, whose tags are plain text
    ("olmo3", "The user asks.</think>\n\nHi!", "The user asks.", "Hi!"),
    ("olmo3", "<think>x</thi</think>y", "x</thi", "y"),
    ("olmo3", "cut before the end", "cut before the end", None),
    # MiniMax-M2: the template opened <think>; a </think> written again in the answer is dropped
    ("minimax_m2", "The user asks.\n</think>\n\nHello!", "The user asks.\n", "Hello!"),
    ("minimax_m2", "<think>a</think>b </think></th</think>c</thin", "a", "b </thc</thin"),
    ("minimax_m2", "cut before the end", "cut before the end", None),
    # ... or nothing is split: the output, the template's <think> in front, is all answer
    ("minimax_m2_append_think", "x</think>\n\ny", None, "<think>x</think>\n\ny"),
    ("minimax_m2_append_think", "", None, "<think>"),
    # GLM-4.5: Qwen3's tags, the model opens the thinking
    ("glm45", "<think>The user asks.</think>\nParis.", "The user asks.", "Paris."),
    ("glm45", "Paris, no thinking.", None, "Paris, no thinking."),
    ("glm45", "<think>cut off </thi", "cut off </thi", None),
]


class FakeTokenizer:
    def get_vocab(self):
        return {
            "<think>": 10,
            "</think>": 11,
            "a": 1,
            "b": 2,
            "[THINK]": 20,
            "[/THINK]": 21,
            "<|assistant|>": 30,
        }


def _parser(spec: str, tokenizer=None, **kwargs):
    name, _, switch = spec.partition("+")
    switches = {switch: True} if switch else None
    return get_reasoning_parser(name)(tokenizer, chat_template_kwargs=switches, **kwargs)


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
    assert _parser(name).extract_reasoning(output) == (reasoning, content)
    for cut in range(len(output) + 1):
        assert _streamed(_parser(name), [output[:cut], output[cut:]]) == (reasoning, content), cut
    assert _streamed(_parser(name), list(output)) == (reasoning, content)


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
    # DeepSeek-V3.1 without thinking: nothing to wait for (structured output from the first token)
    assert _parser("deepseek_v3", FakeTokenizer()).is_reasoning_end([1, 10, 2])
    assert not _parser("deepseek_v3+thinking", FakeTokenizer()).is_reasoning_end([1, 10, 2])
    mistral = _parser("mistral", FakeTokenizer())
    assert (mistral.start_token_id, mistral.end_token_id, mistral.keeps_special_tokens) == (20, 21, True)
    assert mistral.is_reasoning_end([20, 1, 21]) and not mistral.is_reasoning_end([20, 21, 20])


def test_glm45_thinking_ends_after_the_last_assistant_turn():
    """GLM's template writes <think></think> into earlier assistant turns: the thinking has ended only
    at a </think> after the last <|assistant|> (30), so structured output waits for the model's own."""
    tok = FakeTokenizer()
    history = [30, 10, 11, 1, 30]  # an earlier turn's empty thinking, then this turn's <|assistant|>
    parser = get_reasoning_parser("glm45")(tok, prompt_token_ids=history)
    assert not parser.is_reasoning_end(history)
    assert not parser.is_reasoning_end([*history, 10, 2])
    assert parser.is_reasoning_end([*history, 10, 2, 11])
    assert parser.is_reasoning_end([*history, 10, 11])  # enable_thinking=false: the prompt closed it
    assert parser.extract_reasoning("<think>x</think>y") == ("x", "y")
    off = get_reasoning_parser("glm45")(tok, prompt_token_ids=[*history, 10, 11])
    assert off.extract_reasoning("x</think>y") == (None, "x</think>y")

    class NoTurnTag:
        def get_vocab(self):
            return {"<think>": 10, "</think>": 11}

    with pytest.raises(ValueError, match=r"glm45 reasoning parser needs '<\|assistant\|>' as one token"):
        get_reasoning_parser("glm45")(NoTurnTag())


def test_granite_structured_output_starts_after_the_response_marker():
    """With thinking on, the grammar waits for "Here is my response:" as a byte-level BPE (Granite's
    kind) writes it inside a text: the engine's EndOfThinking ends the thinking at its ":"."""
    from helpers.tiny_models import small_byte_tokenizer
    from xlaserve.engine.structured_output.manager import EndOfThinking

    tokenizer = small_byte_tokenizer()
    output = "Here is my thought process:\nHere is: 3.\n\nHere is my response:\n{}"
    ids = tokenizer.encode(output, add_special_tokens=False)
    parser = _parser("granite+thinking", tokenizer)
    assert not parser.is_reasoning_end([]) and _parser("granite", tokenizer).is_reasoning_end([])
    end = EndOfThinking(parser.end_token_id, parser.end_prefix_ids).ends_at(ids)
    assert end is not None and tokenizer.decode(ids[: end + 1]).endswith("\n\nHere is my response:")


def test_tokenizer_without_tags_is_refused():
    class Plain:
        def get_vocab(self):
            return {"a": 0}

    with pytest.raises(ValueError, match="needs '</think>' as one token"):
        get_reasoning_parser("deepseek_r1")(Plain())


def test_registry():
    assert {"deepseek_r1", "deepseek_v3", "qwen3", "granite", "mistral", "olmo3", "glm45"} <= set(
        REASONING_PARSERS
    )
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        get_reasoning_parser("nope")


def test_minimax_m2_parsers_registered_with_their_tags():
    tok = FakeTokenizer()
    for name in ("minimax_m2", "minimax_m2_append_think"):
        parser = get_reasoning_parser(name)(tok, prompt_token_ids=[1, 10])
        assert (parser.start_token_id, parser.end_token_id) == (10, 11)
        assert not parser.is_reasoning_end([1, 10, 2]) and parser.is_reasoning_end([1, 10, 2, 11])
