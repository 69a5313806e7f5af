"""A Hugging Face fast tokenizer rebuilt from a GGUF file's metadata alone.

A GGUF has no tokenizer.json: llama.cpp stores the vocabulary, merges (or scores), token types and
special token ids as metadata. We rebuild the tokenizer they describe so that it encodes and decodes
exactly as `AutoTokenizer.from_pretrained(dir, gguf_file=...)` does, without that path's dependency
on torch-era loading code. Two kinds (`tokenizer.ggml.model`):

- "gpt2": byte-level BPE (SmolLM, Llama 3, Qwen, OLMo 2, Phi-4-mini), text split first by the
  pre-tokenizer the file names (`tokenizer.ggml.pre`); a name we do not know is an error, not a
  silent GPT-2 split.
- "llama": SentencePiece BPE (Llama 2, Mistral, Gemma 3): "▁" for spaces, one prepended to the text,
  bytes without a token spelled as <0xNN> tokens, and no merges in the file: a token that splits into
  two tokens of the vocabulary is their merge, ranked by its score (higher first), as llama.cpp
  merges. Gemma's files differ from the vocabulary they were converted from in two ways, both undone:
  their scores do not follow the merge order, the vocabulary's order does, and a user-defined token of
  whitespace stores its "▁"s as spaces ("\n▁" as "\n "; transformers' conversion respells only runs
  of spaces right, and makes "\n " a second "▁▁"). Phi-3's prepend their "▁" to text that starts with
  a space too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast

from xlaserve.models.gguf_reader import open_gguf, read_gguf_metadata

# llama.cpp token types (tokenizer.ggml.token_type).
_CONTROL = 3
_USER_DEFINED = 4

# Pre-tokenizer split patterns by `tokenizer.ggml.pre`; the names in `_GPT2_SPLIT` use the GPT-2
# split built into `pre_tokenizers.ByteLevel`, any other name is refused.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-4o's (o200k): cased words as units, a contraction kept on its word, "/" kept on punctuation.
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    "gpt-4o": _GPT4O_SPLIT,  # Phi-4-mini
}
# GPT-2's own split. "smollm": llama.cpp splits digits apart first, but SmolLM's vocabulary has no
# token of two digits, so the ids are the same. "olmo" (OLMo 1.7; OLMo 2's files say "dbrx"): llama.cpp
# splits it as GPT-2. None / "default": a file from before llama.cpp wrote the key, which transformers
# reads with GPT-2's split too.
_GPT2_SPLIT = (None, "default", "gpt2", "gpt-2", "smollm", "olmo")
# Architectures whose SentencePiece files are Gemma's (see the module's docstring).
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
_SPACE = "\u2581"  # SentencePiece's "▁", a space inside a token


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
    if pre in _GPT2_SPLIT:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    split = _PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        known = sorted([*_PRE_TOKENIZER_SPLITS, *(name for name in _GPT2_SPLIT if name)])
        raise ValueError(
            f"GGUF tokenizer.ggml.pre {pre!r} is not supported: its split of the text is unknown here "
            f"(known pre-tokenizers: {', '.join(known)})"
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _byte_level_backend(metadata: Mapping[str, Any], tokens: list[str]) -> tuple[Tokenizer, dict[str, int]]:
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
    return backend, vocab


def _sentencepiece_backend(
    metadata: Mapping[str, Any], tokens: list[str]
) -> tuple[Tokenizer, dict[str, int]]:
    scores = metadata.get("tokenizer.ggml.scores")
    if metadata.get("general.architecture") in _GEMMA_ARCHITECTURES:
        scores = [-i for i in range(len(tokens))]  # earlier merges first
    if scores is None:
        raise ValueError("GGUF SentencePiece tokenizer has no tokenizer.ggml.scores to rank its merges by")
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = Tokenizer(
        BPE(
            vocab=vocab,
            merges=_merges_by_score(tokens, [float(x) for x in scores]),
            dropout=None,
            fuse_unk=True,
            byte_fallback=True,  # a character without a token: its UTF-8 bytes' <0xNN> tokens
        )
    )
    # llama.cpp prepends a space unless the file says not to (transformers ignores the flag).
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    if prefix and metadata.get("general.architecture") == "phi3":
        # Phi-3's: a "▁" before the text even when it starts with a space, and after each special
        # token (transformers' conversion, as llama.cpp tokenizes any SentencePiece file).
        backend.normalizer = normalizers.Sequence(
            [normalizers.Prepend(_SPACE), normalizers.Replace(" ", _SPACE)]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=_SPACE, prepend_scheme="first" if prefix else "never", split=False
        )
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)
    return backend, vocab


def _merges_by_score(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE's merges, which its file does not list: every way a token splits into two
    tokens of the vocabulary, best first by the whole token's score (llama.cpp merges the adjacent
    pair whose joined token scores highest); ties by the longer left piece, then the longer right
    one, then the vocabulary's order (the order transformers' GGUF conversion gives)."""
    ids = {token: i for i, token in enumerate(tokens)}
    ranked = []
    for token, score in dict(zip(tokens, scores)).items():
        splits = [
            (token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in ids and token[k:] in ids
        ]
        splits.sort(key=lambda pair: (ids[pair[0]], ids[pair[1]]))
        ranked += [(score, len(left), len(right), left, right) for left, right in splits]
    ranked.sort(key=lambda merge: merge[:3], reverse=True)  # stable: equal keys keep their order
    return [(left, right) for *_, left, right in ranked]


def tokenizer_from_gguf_metadata(metadata: Mapping[str, Any]) -> PreTrainedTokenizerFast:
    """Build the tokenizer described by GGUF metadata (`read_gguf_metadata`'s dict).

    Byte-level BPE (`tokenizer.ggml.model == "gpt2"`: SmolLM, Llama 3, Qwen, OLMo 2, Phi-4-mini) and
    SentencePiece BPE ("llama": Llama 2, Mistral, Gemma 3, Phi-3); others raise ValueError, as does a
    byte-level file whose `tokenizer.ggml.pre` names a split we do not know.
    """
    kind = metadata.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ValueError(
            f"GGUF tokenizer.ggml.model {kind!r} is not supported: expected 'gpt2' (byte-level BPE) "
            "or 'llama' (SentencePiece BPE)"
        )
    is_byte_level = kind == "gpt2"
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    if not is_byte_level and metadata.get("general.architecture") in _GEMMA_ARCHITECTURES:
        # llama.cpp's converter writes the "▁"s of Gemma's user-defined whitespace tokens ("▁▁", "\n▁",
        # "▁\t") as spaces: each "▁" back, so BPE reaches them and they are added as the vocabulary's.
        tokens = [t.replace(" ", _SPACE) if " " in t and not t.strip() else t for t in tokens]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    backend, vocab = (_byte_level_backend if is_byte_level else _sentencepiece_backend)(metadata, tokens)

    # Control tokens (<|im_start|>, Mistral's [INST]) are matched whole and skipped by
    # skip_special_tokens; user-defined ones (<think>) are matched whole but kept. A byte-level
    # "control" token outside the byte alphabet is a llama.cpp mislabel whose respelling would not be
    # in the vocabulary: adding it would grow the vocabulary past the model's, so it is left to BPE.
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, token_types)
        if kind == _CONTROL and (not is_byte_level or set(token) <= _ALPHABET)
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

    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
    kwargs: dict[str, Any] = {} if is_byte_level else {"add_bos_token": True}
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
