"""What transformers decides about a model directory is remembered across starts
(models/transformers_memo.py): a warm start loads the same config and tokenizer without importing torch,
which transformers' config classes and AutoTokenizer import whenever it is installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers.tiny_models import small_byte_tokenizer
from xlaserve.models import transformers_memo
from xlaserve.models.loader import _read_config_json, directory_tokenizer

# A config.json as an older transformers wrote it: the family's defaults (rope_theta, layer_types'
# absence, id2label) come from LlamaConfig.
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}
TEXT = '{"tags": ["red"]} The quick brown fox'
# Prints what a start reads of the directory, and whether torch came in.
READ = """
import json, sys
from xlaserve.models.loader import _read_config_json, directory_tokenizer
config, tokenizer = _read_config_json(sys.argv[1]), directory_tokenizer(sys.argv[1])
ids = tokenizer(sys.argv[2])["input_ids"]
print(json.dumps([config, type(tokenizer).__name__, ids, "torch" in sys.modules]))
"""


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XLASERVE_COMPILATION_CACHE_DIR", str(tmp_path / "cache"))
    directory = tmp_path / "model"
    small_byte_tokenizer().save_pretrained(directory)
    (directory / "config.json").write_text(json.dumps(CONFIG))
    return str(directory)


def test_a_warm_start_reads_the_same_model_without_torch(model_dir):
    from transformers import AutoTokenizer

    config, tokenizer = _read_config_json(model_dir), directory_tokenizer(model_dir)  # cold: remembered
    auto = AutoTokenizer.from_pretrained(model_dir)
    assert type(tokenizer) is type(auto)
    assert config["rope_theta"] == 10000.0 and config["id2label"] == {"0": "LABEL_0", "1": "LABEL_1"}
    out = subprocess.run(
        [sys.executable, "-c", READ, model_dir, TEXT],
        capture_output=True,
        text=True,
        check=True,
        env=os.environ,
    )
    warm_config, name, ids, has_torch = json.loads(out.stdout)
    assert warm_config == config
    assert name == type(auto).__name__
    assert ids == auto(TEXT)["input_ids"] == tokenizer(TEXT)["input_ids"]
    assert len(ids) > 3
    assert not has_torch


def test_a_changed_directory_is_asked_again(model_dir):
    """A JSON file keys the choice by its size and modification time, not its contents (tokenizer.json is
    MBs, and the key is made at every start): a file written anew with the same bytes is asked again;
    bytes changed under the same size and time (no edit or download does that) are not even read."""
    before = transformers_memo.tokenizer_choice_key(model_dir, False)
    path = os.path.join(model_dir, "tokenizer.json")
    st = os.stat(path)
    with open(path, "r+b") as f:
        data = f.read()
        f.seek(0)
        f.write(data.swapcase())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert transformers_memo.tokenizer_choice_key(model_dir, False) == before
    with open(path, "wb") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert transformers_memo.tokenizer_choice_key(model_dir, False) != before
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
        tokenizer_config = json.load(f)
    tokenizer_config["auto_map"] = {"AutoTokenizer": [None, "tok.MyTokenizer"]}
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config, f)
    assert transformers_memo.tokenizer_choice_key(model_dir, False) != before
    assert transformers_memo.tokenizer_choice_key(model_dir, True) != transformers_memo.tokenizer_choice_key(
        model_dir, False
    )


class OwnTokenizer:  # a class of the directory's own code (trust_remote_code), not transformers'
    pass


def test_a_directory_s_own_tokenizer_class_is_never_remembered(model_dir):
    calls = []

    def load():
        calls.append(1)
        return OwnTokenizer()

    for _ in range(2):
        assert isinstance(transformers_memo.auto_tokenizer(model_dir, True, load), OwnTokenizer)
    assert len(calls) == 2


def test_an_unreadable_entry_is_worked_out_again(model_dir):
    key = ["llama", {"x": 1}]
    assert transformers_memo.remembered("test", key, lambda: {"a": (1, 2)}) == {"a": [1, 2]}  # JSON's form
    assert transformers_memo.remembered("test", key, lambda: {"a": 3}) == {"a": [1, 2]}
    (entry,) = os.listdir(os.path.join(transformers_memo.memo_dir(), "test"))
    with open(os.path.join(transformers_memo.memo_dir(), "test", entry), "w") as f:
        f.write('{"a": ')  # a start killed mid-write would leave no such file (rename), a bad disk might
    assert transformers_memo.remembered("test", key, lambda: {"a": 3}) == {"a": 3}
    assert transformers_memo.remembered("test", key, lambda: {"a": 4}) == {"a": 3}
    assert transformers_memo.remembered("test", {"no": object()}, lambda: 5) == 5  # a key JSON cannot say
