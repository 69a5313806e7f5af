"""The GGUF tokenizers of Gemma 3, OLMo 2 and Phi-4-mini against transformers' own GGUF tokenizer
conversion, on small vocabularies learned here and written as llama.cpp's converter writes them.

- Gemma 3 (`gemma3`, SentencePiece "llama"): <pad> <eos> <bos> <unk> first, turn markers as control
  tokens, user-defined whitespace tokens (runs of spaces, newlines and tabs, and spaces mixed with
  them), the 256 byte tokens, then the pieces, with scores that do not follow the order they were
  learned in (Gemma's do not either: the file's order ranks its merges); no space prefix. llama.cpp's
  converter writes a user-defined token's "▁"s as spaces; the reference is the tokenizer of the
  original vocabulary ("▁"s kept, as in Gemma's tokenizer.json), read by transformers from a twin
  file. transformers' reading of the converter's file spells every whitespace token with a space as
  that many "▁"s, so "\n▁" and "▁▁" would be one token to it.
- OLMo 2 (`olmo2`, byte-level "gpt2", pre-tokenizer "dbrx", cl100k's split) and Phi-4-mini (`phi3`,
  pre-tokenizer "gpt-4o", o200k's split): merges learned with GPT-2's split, so a wrong split (digits
  in threes or not, a contraction on its word or not) shows as other ids. "olmo" (OLMo 1.7) splits
  as GPT-2.
"""

from __future__ import annotations

import functools
import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from helpers import tokenizer_texts
from helpers.perplexity_text import TEXT
from helpers.tiny_models import write_tokenizer_gguf
from xlaserve.models.tokenizer import load_tokenizer

CORPUS = [
    TEXT,
    "12345 678901 2024-01-31 3.14159 1,000,000 x2 v1.2.3",
    "I'm sure they'll say we've done it, don't you think? It's John's CamelCaseWord HTTPServer.",
    "Größe café naïve über 日本 東京 the the   the\tthe\n\n  indented\n    more",
    "a/b/c path/to/file.py <tag> {json: [1, 2]} !!! ???",
]
SAMPLES = [
    *tokenizer_texts.SAMPLES,
    "I'm sure they'll say we've done it, don't you think? It's John's.",
    "CamelCaseWord HTTPServer getHTTPResponseCode",
    "12345 678901 1234567890 1,000,000",
    "a/b/c path/to/file.py\n/usr/bin",
    "  indented\n    more\n\tand tabs",
]


def _texts(specials: list[str]) -> list[str]:
    """SAMPLES, the special tokens amid text, and random mixes of them and of a few scripts."""
    pieces = [
        *SAMPLES,
        *specials,
        " ",
        "  ",
        "\n",
        "\t",
        " \n",
        "\n ",
        "\t ",
        "é",
        "日",
        "😀",
        "the",
        "'s",
        "123",
    ]
    return [*SAMPLES, *(f"x {s}y{s} {s}" for s in specials), *tokenizer_texts.random_texts(120, pieces)]


GEMMA_CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
# Gemma's whitespace tokens, user-defined, as the original vocabulary spells them (runs of spaces
# first: ids 7-10); the converter writes their "▁"s as spaces, a reader must respell them.
GEMMA_WHITESPACE = [
    *("▁" * n for n in range(2, 6)),
    *["\n", "\n\n", "\t\t", "▁\n", "\n▁", "\n▁▁", "▁▁\n", "\t▁", "▁\t"],
]


def write_gemma3(path, arch: str, *, as_converted: bool = True) -> None:
    """Gemma 3's file as llama.cpp's converter writes it, or (`as_converted=False`) with the original
    vocabulary's spelling of its whitespace tokens."""
    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    learner.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, show_progress=False))
    pieces = [
        p
        for p, _ in sorted(learner.get_vocab().items(), key=lambda item: item[1])
        if "▁▁" not in p and "\n" not in p
    ]
    whitespace = [t.replace("▁", " ") if as_converted else t for t in GEMMA_WHITESPACE]
    tokens = [*GEMMA_CONTROL, *whitespace, *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    # llama.cpp's token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte.
    types = [3, 3, 3, 2, 3, 3, 3, *[4] * len(whitespace), *[6] * 256, *[1] * len(pieces)]
    # Scores unrelated to the pieces' order: a reader ranking merges by them splits words otherwise.
    scores = [0.0] * (len(tokens) - len(pieces)) + random.Random(1).sample(
        range(-len(pieces), 0), len(pieces)
    )

    def add_tokenizer(writer):
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores([float(s) for s in scores])
        writer.add_token_types(types)
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_unk_token_id(3)
        writer.add_pad_token_id(0)
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)
        writer.add_add_space_prefix(False)  # Gemma's converter writes it

    write_tokenizer_gguf(path, arch, len(tokens), add_tokenizer)


BYTE_LEVEL_CONTROL = {
    "dbrx": ["<|endoftext|>", "<|pad|>"],
    "gpt-4o": ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
    "olmo": ["<|endoftext|>", "<|padding|>"],
}


def write_byte_level(path, pre: str, arch: str) -> None:
    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    learner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    learner.train_from_iterator(CORPUS, trainer)
    model = learner.get_vocab()
    pieces = [p for p, _ in sorted(model.items(), key=lambda item: item[1])]
    merges = [" ".join(pair) for pair in json.loads(learner.to_str())["model"]["merges"]]
    control = BYTE_LEVEL_CONTROL[pre]
    tokens = [*pieces, *control]  # the specials after the vocabulary, as cl100k / o200k put them

    def add_tokenizer(writer):
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types([1] * len(pieces) + [3] * len(control))
        writer.add_token_merges(merges)
        eot = tokens.index("<|endoftext|>")
        writer.add_bos_token_id(eot)
        writer.add_eos_token_id(eot)
        writer.add_pad_token_id(len(pieces) + 1)
        writer.add_add_bos_token(False)

    write_tokenizer_gguf(path, arch, len(tokens), add_tokenizer)


# name -> (writer(path, architecture), special tokens, the file's architecture). transformers reads
# no olmo2 or olmo file: its reference is read from a twin file under "llama" (a byte-level
# tokenizer's conversion does not depend on the architecture); Gemma 3's from a twin file spelled as
# the original vocabulary (`TWINS`).
CASES = {
    "gemma3": (write_gemma3, GEMMA_CONTROL, "gemma3"),
    "olmo2": (functools.partial(write_byte_level, pre="dbrx"), BYTE_LEVEL_CONTROL["dbrx"], "olmo2"),
    "phi4-mini": (functools.partial(write_byte_level, pre="gpt-4o"), BYTE_LEVEL_CONTROL["gpt-4o"], "phi3"),
    "olmo": (functools.partial(write_byte_level, pre="olmo"), BYTE_LEVEL_CONTROL["olmo"], "olmo"),
}
_READ_BY_TRANSFORMERS = ("phi3",)
TWINS = {"gemma3": (functools.partial(write_gemma3, as_converted=False), "gemma3")}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(name, ours, transformers', texts) for one family's file."""
    write, specials, arch = CASES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    write(directory / "tiny.gguf", arch=arch)
    reference_file = "tiny.gguf"
    if arch not in _READ_BY_TRANSFORMERS:
        reference_file = "twin.gguf"
        write_twin, twin_arch = TWINS.get(request.param, (write, "llama"))
        write_twin(directory / reference_file, arch=twin_arch)
    reference = AutoTokenizer.from_pretrained(str(directory), gguf_file=reference_file)
    return request.param, load_tokenizer(str(directory / "tiny.gguf")), reference, _texts(specials)


def test_vocab_and_special_tokens_match_transformers(case):
    _, ours, reference, _ = case
    assert ours.get_vocab() == reference.get_vocab() and len(ours) == len(reference)
    # GemmaTokenizer names a mask token by default, the file does not (it is a control token either way).
    expected = {k: v for k, v in reference.special_tokens_map.items() if k != "mask_token"}
    assert ours.special_tokens_map == expected
    assert {i: (t.content, t.special) for i, t in ours.added_tokens_decoder.items()} == {
        i: (t.content, t.special) for i, t in reference.added_tokens_decoder.items()
    }


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_ids_match_transformers(case, add_special_tokens):
    _, ours, reference, texts = case
    expected = reference(texts, add_special_tokens=add_special_tokens)["input_ids"]
    actual = ours(texts, add_special_tokens=add_special_tokens)["input_ids"]
    for text, want, got in zip(texts, expected, actual):
        assert got == want, f"ids differ for {text!r}"


def test_decode_matches_transformers(case):
    _, ours, reference, texts = case
    rng = random.Random(1)
    id_lists = reference(texts)["input_ids"]
    # Arbitrary ids too: special ids anywhere, byte tokens that split a UTF-8 sequence.
    id_lists += [[rng.randrange(len(reference)) for _ in range(rng.randint(1, 30))] for _ in range(50)]
    for skip in (True, False):
        assert ours.batch_decode(id_lists, skip_special_tokens=skip) == reference.batch_decode(
            id_lists, skip_special_tokens=skip
        )


# Each family's own rule, as the tokens of "CamelCaseWord 12345" (GPT-2's split keeps " 12345" whole,
# cl100k's and o200k's cut digits in threes; o200k's also cuts a word where its case changes).
FAMILY_TOKENS = {
    "olmo2": ["Came", "lCas", "eWor", "d", "Ġ", "12", "3", "4", "5"],
    "phi4-mini": ["Came", "l", "Cas", "e", "Wor", "d", "Ġ", "12", "3", "4", "5"],
    "olmo": ["Came", "lCas", "eWor", "d", "Ġ", "12", "34", "5"],
}


def test_what_each_family_changes(case):
    """What a reader without the family's rule would get wrong, pinned beside transformers' ids."""
    name, ours, _, _ = case
    if name != "gemma3":
        ids = ours("CamelCaseWord 12345", add_special_tokens=False)["input_ids"]
        assert ours.convert_ids_to_tokens(ids) == FAMILY_TOKENS[name]
        return
    # Runs of spaces are the file's space tokens (ids 7, 9: "  ", "    "), no "▁" is prepended, BOS is.
    ids = ours("  indented\n    more")["input_ids"]
    assert ids[:2] == [ours.bos_token_id, 7] and 9 in ids
    # A space then a tab: the file's " \t" (id 19), respelled "▁\t" (a reader that respells only runs
    # of spaces cannot reach it; transformers' reading of the file makes it a second "▁▁").
    assert ours.convert_ids_to_tokens(ours("a \tb", add_special_tokens=False)["input_ids"]) == [
        "a",
        "▁\t",
        "b",
    ]
    assert ours.convert_ids_to_tokens(ids[2]) == "ind"
