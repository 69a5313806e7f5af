"""A Hugging Face fast tokenizer rebuilt from a GGUF file's metadata alone.

A GGUF has no tokenizer.json: llama.cpp stores the vocabulary, merges, token types and special
token ids as metadata. We rebuild the byte-level BPE tokenizer they describe so that it encodes and
decodes exactly as `AutoTokenizer.from_pretrained(dir, gguf_file=...)` does, without that path's
dependency on torch-era loading code.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast

from xlaserve.models.gguf_reader import open_gguf, read_gguf_metadata

# llama.cpp token types (tokenizer.ggml.token_type).
_CONTROL = 3
_USER_DEFINED = 4

# Pre-tokenizer split patterns by `tokenizer.ggml.pre`; any other value (gpt2, smollm, ...) uses
# the GPT-2 split built into `pre_tokenizers.ByteLevel`.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (printable latin-1 maps to itself)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    shifted = [b for b in range(256) if b not in printable]
    mapping = {b: chr(b) for b in printable}
    mapping.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return mapping


_BYTE_TO_CHAR = _byte_alphabet()
_ALPHABET = frozenset(_BYTE_TO_CHAR.values())


def _byte_level_spelling(token: str) -> str:
    # Vocabularies are stored in the byte alphabet ("Ġthe"); a token that is not (some converters
    # write added tokens as raw text) is respelled from its UTF-8 bytes so BPE can reach it.
    if set(token) <= _ALPHABET:
        return token
    return "".join(_BYTE_TO_CHAR[b] for b in token.encode("utf-8"))


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    split = _PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def tokenizer_from_gguf_metadata(metadata: Mapping[str, Any]) -> PreTrainedTokenizerFast:
    """Build the tokenizer described by GGUF metadata (`read_gguf_metadata`'s dict).

    Only byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`: SmolLM, Llama 3, Qwen) are
    supported; others raise ValueError.
    """
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"GGUF tokenizer.ggml.model {kind!r} is not supported: expected 'gpt2' (byte-level BPE)"
        )
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]

    vocab = {_byte_level_spelling(token): i for i, token in enumerate(tokens)}
    backend = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    backend.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()

    # Control tokens (<|im_start|>) are matched whole and skipped by skip_special_tokens; user-defined
    # ones (<think>) are matched whole but kept. A "control" token outside the byte alphabet is a
    # llama.cpp mislabel whose respelling would not be in the vocabulary: adding it would grow the
    # vocabulary past the model's, so it is left to BPE.
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, token_types)
        if kind == _CONTROL and set(token) <= _ALPHABET
    ]
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(tokens, token_types)
        if kind == _USER_DEFINED and token in vocab
    ]
    backend.add_special_tokens(control)
    backend.add_tokens(user_defined)

    def special(name: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{name}_token_id")
        return tokens[token_id] if token_id is not None else None

    kwargs: dict[str, Any] = {}
    for flag in ("add_bos_token", "add_eos_token"):
        if f"tokenizer.ggml.{flag}" in metadata:
            kwargs[flag] = bool(metadata[f"tokenizer.ggml.{flag}"])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=special("bos"),
        eos_token=special("eos"),
        unk_token=special("unknown"),
        pad_token=special("padding"),
        chat_template=metadata.get("tokenizer.chat_template"),
        **kwargs,
    )


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """The tokenizer of a GGUF file; see `tokenizer_from_gguf_metadata`."""
    return tokenizer_from_gguf_metadata(read_gguf_metadata(open_gguf(path)))
