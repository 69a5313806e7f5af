"""GET /tokenizer_info (vLLM's, --enable-tokenizer-info-endpoint): the tokenizer's configuration and
chat template, for a GGUF tokenizer (the embedded SmolLM2) and a directory's, and on the session server
(which runs with the flag) as lm-eval's remote tokenizer reads it: its `eos_token`, tokenized through
/tokenize, is the tokenizer's EOS id.

lm-eval itself is not installed here: it pulls datasets, pandas, pyarrow, scikit-learn and nltk (about
40 packages), and a task's data comes from a hub. So the test checks what lm-eval's `local-completions`
reads (RemoteTokenizer: /tokenizer_info, /tokenize with add_special_tokens false, /detokenize) against
the tokenizer instead.
"""

from __future__ import annotations

import json

import httpx

from helpers.smollm2 import smollm2_gguf_path
from helpers.tiny_models import small_byte_tokenizer
from xlaserve.entrypoints.openai.tokenizer_info import tokenizer_info
from xlaserve.models.tokenizer import directory_tokenizer, load_tokenizer


def check_info(info: dict, tokenizer, chat_template: str | None) -> None:
    assert json.loads(json.dumps(info, allow_nan=False)) == info  # plain JSON
    assert info["tokenizer_class"] == type(tokenizer).__name__
    for key in ("bos_token", "eos_token"):
        assert info[key] == getattr(tokenizer, key), key
    assert info.get("chat_template") == chat_template
    assert not [key for key in info if key.endswith("_file") or key == "name_or_path"]  # no server paths


def test_gguf_tokenizer_info():
    tokenizer = load_tokenizer(smollm2_gguf_path())
    info = tokenizer_info(tokenizer, None)
    check_info(info, tokenizer, tokenizer.chat_template)
    assert info["eos_token"] == "<|im_end|>" and "<|im_start|>assistant" in info["chat_template"]
    # the server's --chat-template is the one it renders with, so the one it reports
    assert tokenizer_info(tokenizer, "{{ messages }}")["chat_template"] == "{{ messages }}"


def test_directory_tokenizer_info(tmp_path):
    """A directory's tokenizer: AddedTokens as their text, the backend object and file paths left out."""
    small_byte_tokenizer().save_pretrained(tmp_path)
    tokenizer = directory_tokenizer(str(tmp_path))
    info = tokenizer_info(tokenizer, None)
    check_info(info, tokenizer, None)
    assert info["eos_token"] == "<|endoftext|>"
    assert "tokenizer_object" not in info
    decoder = info.get("added_tokens_decoder")
    assert decoder is None or decoder == {str(tokenizer.eos_token_id): "<|endoftext|>"}


def test_values_json_cannot_carry_are_dropped_and_special_tokens_filled():
    class Stub:
        init_kwargs = {
            "model_max_length": float("inf"),
            "backend": object(),
            "nested": {1: [object(), "a", 2.5]},
            "vocab_file": "/srv/models/vocab.json",
        }
        special_tokens_map = {"eos_token": "</s>", "additional_special_tokens": ["<x>"]}
        chat_template = None

    info = tokenizer_info(Stub(), None)
    assert info == {
        "model_max_length": None,
        "nested": {"1": ["a", 2.5]},
        "eos_token": "</s>",
        "tokenizer_class": "Stub",
    }


# -- on the session server ---------------------------------------------------------------------------


def test_server_tokenizer_info_is_what_lm_eval_reads(server):
    """What lm-eval's RemoteTokenizer (local-completions, tokenizer_backend auto/remote) does with it:
    the info has eos_token; /tokenize of it without special tokens is the EOS id, /detokenize gives it
    back; the chat template is the tokenizer's."""
    tokenizer = load_tokenizer(smollm2_gguf_path())
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as client:
        response = client.get("/tokenizer_info")
        assert response.status_code == 200, response.text
        info = response.json()
        assert info == tokenizer_info(tokenizer, None)
        check_info(info, tokenizer, tokenizer.chat_template)
        ids = client.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})
        assert ids.json()["tokens"] == [tokenizer.eos_token_id]
        text = client.post("/detokenize", json={"tokens": [tokenizer.eos_token_id]}).json()["prompt"]
        assert text == info["eos_token"]
