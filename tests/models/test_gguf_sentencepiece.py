"""SentencePiece GGUF tokenizers (`tokenizer.ggml.model` "llama": Llama 2, Mistral) against
transformers' own GGUF tokenizer conversion, on a small GGUF written here; and the pre-tokenizer
names a byte-level GGUF may give.

The vocabulary is a SentencePiece-style BPE one, as llama.cpp stores it: <unk>, <s>, </s>, the 256
<0xNN> byte tokens, two control tokens and a user-defined one, then pieces ("▁the") with scores and
no merges. The pieces are learned here (tokenizers' BPE trainer, "▁" for spaces) from a few
sentences, so that many characters of the test strings have no token (byte fallback).
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from helpers import tokenizer_texts
from helpers.perplexity_text import TEXT
from helpers.tiny_models import write_tokenizer_gguf
from xlaserve.models.gguf_tokenizer import load_gguf_tokenizer, tokenizer_from_gguf_metadata
from xlaserve.models.tokenizer import load_tokenizer

CORPUS = [TEXT, "Größe café naïve über 日本 東京 the the   the\tthe"]
CONTROL, USER_DEFINED = ["[INST]", "[/INST]"], ["<|tool|>"]

SAMPLES = [
    *tokenizer_texts.SAMPLES,
    "<0x41> looks like a byte token",
    "<s> and </s> and <unk> written as text",
    "[INST] What is 2+2? [/INST] 4</s>",
    "[INST][/INST][INST]",
    " [INST] a space before a control token",
    "<|tool|>call(x)<|tool|> done",
    "[INST <|tool| [/INST",
]
TEXTS = SAMPLES + tokenizer_texts.random_texts(
    150, [*SAMPLES, " ", "  ", "\n", "[INST]", "<|tool|>", "é", "日", "😀", "the"]
)


def _pieces() -> list[str]:
    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.Metaspace()
    learner.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, show_progress=False))
    return [piece for piece, _ in sorted(learner.get_vocab().items(), key=lambda item: item[1])]


def _write_sentencepiece_gguf(path, arch: str = "llama", **tokenizer_flags) -> list[str]:
    pieces = _pieces()
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *CONTROL, *USER_DEFINED, *pieces]
    # llama.cpp's token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte.
    types = [2, 3, 3, *[6] * 256, *[3] * len(CONTROL), *[4] * len(USER_DEFINED), *[1] * len(pieces)]
    # Scores fall with the order the pieces were learned in: merges rank by them.
    scores = [0.0] * (len(tokens) - len(pieces)) + [-float(i) for i in range(len(pieces))]

    def add_tokenizer(writer):
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        for flag, value in tokenizer_flags.items():
            writer.add_bool(f"tokenizer.ggml.{flag}", value)

    write_tokenizer_gguf(path, arch, len(tokens), add_tokenizer)
    return tokens


@pytest.fixture(scope="module", params=["llama", "phi3"])
def gguf_path(request, tmp_path_factory):
    """The file as Llama 2's, then as Phi-3-mini's (a "▁" before text that starts with a space too)."""
    path = tmp_path_factory.mktemp("spm") / "tiny-spm.gguf"
    _write_sentencepiece_gguf(path, request.param)
    return path


@pytest.fixture(scope="module")
def reference(gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def ours(gguf_path):
    return load_tokenizer(str(gguf_path))  # what AsyncLLM and the loaders call on a .gguf


def test_vocab_and_special_tokens_match_transformers(ours, reference):
    assert ours.get_vocab() == reference.get_vocab() and len(ours) == len(reference)
    assert ours.special_tokens_map == reference.special_tokens_map
    assert (ours.bos_token_id, ours.eos_token_id, ours.unk_token_id) == (1, 2, 0)
    assert {i: (t.content, t.special) for i, t in ours.added_tokens_decoder.items()} == {
        i: (t.content, t.special) for i, t in reference.added_tokens_decoder.items()
    }


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_ids_match_transformers(ours, reference, add_special_tokens):
    expected = reference(TEXTS, add_special_tokens=add_special_tokens)["input_ids"]
    actual = ours(TEXTS, add_special_tokens=add_special_tokens)["input_ids"]
    for text, want, got in zip(TEXTS, expected, actual):
        assert got == want, f"ids differ for {text!r}"
    # The cases that make it SentencePiece: BOS first, the prepended "▁", bytes for unknown characters.
    ids = ours("Größe 😀")["input_ids"]
    assert ids[0] == ours.bos_token_id and ours.convert_ids_to_tokens(ids[1]).startswith("▁")
    assert "<0xF0>" in ours.convert_ids_to_tokens(ids)  # the emoji's first UTF-8 byte
    assert ours("[INST] hi", add_special_tokens=False)["input_ids"][0] == ours.convert_tokens_to_ids("[INST]")


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(ours, reference, skip_special_tokens):
    rng = random.Random(1)
    id_lists = reference(TEXTS)["input_ids"]
    # Arbitrary ids too: special ids anywhere, byte tokens that split a UTF-8 sequence.
    id_lists += [[rng.randrange(len(reference)) for _ in range(rng.randint(1, 30))] for _ in range(100)]
    expected = reference.batch_decode(id_lists, skip_special_tokens=skip_special_tokens)
    assert ours.batch_decode(id_lists, skip_special_tokens=skip_special_tokens) == expected
    # SentencePiece's decode drops one leading space (the prepended one) and skipped specials; Phi-3's
    # "▁" after an added token stays.
    lossless = [t for t in SAMPLES if not t.startswith(" ") and "▁" not in t and not _has_special(t)]
    assert len(lossless) >= 15
    assert ours.batch_decode(ours(lossless)["input_ids"], skip_special_tokens=True) == lossless


def _has_special(text: str) -> bool:
    return any(token in text for token in ("<s>", "</s>", "<unk>", *CONTROL, *USER_DEFINED))


def test_add_space_prefix_false_prepends_nothing(tmp_path):
    # llama.cpp honours the flag (transformers' conversion ignores it, so no reference here).
    path = tmp_path / "no-prefix.gguf"
    _write_sentencepiece_gguf(path, add_space_prefix=False, add_bos_token=False)
    tokenizer = load_gguf_tokenizer(str(path))
    ids = tokenizer("the keeper")["input_ids"]
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert not tokens[0].startswith("▁") and tokens[-1] == "▁keeper"  # no BOS either
    assert tokenizer.decode(ids) == "the keeper"  # nothing stripped


def test_unknown_pre_tokenizer_is_refused_by_name():
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "tekken",
        "tokenizer.ggml.tokens": ["a", "b", "ab"],
        "tokenizer.ggml.merges": ["a b"],
    }
    with pytest.raises(
        ValueError, match=r"tokenizer.ggml.pre 'tekken' is not supported.*llama-bpe.*qwen2.*smollm"
    ):
        tokenizer_from_gguf_metadata(metadata)
    for known in ("llama-bpe", "qwen2", "smollm", "gpt2"):
        assert tokenizer_from_gguf_metadata(dict(metadata, **{"tokenizer.ggml.pre": known}))("ab")[
            "input_ids"
        ] == [2]
    del metadata["tokenizer.ggml.pre"]  # a file from before llama.cpp wrote the key: GPT-2's split
    assert tokenizer_from_gguf_metadata(metadata)("ab")["input_ids"] == [2]
