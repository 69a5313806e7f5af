"""What transformers decides about a model, remembered on disk beside the compilation cache.

transformers 5's configuration classes and its AutoTokenizer import torch whenever it is installed
(`configuration_utils`, `activations`: ~1.5-3 CPU s a process, most of a tiny server's start), yet
their answers here (a config class's defaults, the tokenizer class AutoTokenizer picks for a
directory) depend only on the model's small files and transformers' version. So each is worked out
once, by whichever process asks first, and read back by every later start: the server's front end and
its engine core, each `LLM`. A warm start then imports no torch for a model directory (what it loads
is unchanged: the remembered class reads the directory itself).

Entries are small JSON files under `<compilation cache>/transformers`, keyed by a hash of what the
answer depends on; one that is missing or unreadable is worked out again and rewritten (written to a
temporary file and renamed into place: processes share the directory). A remembered value is its JSON
form on the first start too, so a cold and a warm start see the same dict (config.json's own form:
string keys in `id2label`, lists for tuples).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

import transformers

from xlaserve.config.compilation import default_compilation_cache_dir

# A directory's files that can change AutoTokenizer's choice (tokenizer_config.json's class and
# auto_map, config.json's model_type, tokenizer.json's pre-tokenizer): their size and modification time
# key it, as the KV disk tier's name keys a checkpoint (not their contents: tokenizer.json is MBs for a big
# vocabulary, read at every start by both processes); the other files, by name only (which exist:
# tokenizer.model, tekken.json).
_CHOICE_SUFFIX = ".json"


def memo_dir() -> str:
    return os.path.join(default_compilation_cache_dir(), "transformers")


def remembered(kind: str, key: Any, compute: Callable[[], Any]) -> Any:
    """`compute()`'s JSON-able answer for `key` (JSON-able), read back when an earlier start stored it.
    An answer that does not survive JSON is returned as it is and not stored."""
    try:
        digest = hashlib.sha256(json.dumps([transformers.__version__, key], sort_keys=True).encode())
    except (TypeError, ValueError):  # a key JSON cannot say (a config built in code): not remembered
        return compute()
    path = os.path.join(memo_dir(), kind, digest.hexdigest() + ".json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        pass
    value = compute()
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        return value
    _write(path, text)
    return json.loads(text)


def _write(path: str, text: str) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:  # a read-only or full disk: the answer is still right, only not remembered
        pass


def tokenizer_choice_key(path: str, trust_remote_code: bool) -> list:
    """What AutoTokenizer reads of directory `path` to choose a class."""
    files = []
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name.endswith(_CHOICE_SUFFIX) and os.path.isfile(full):
            files.append([name, (st := os.stat(full)).st_size, st.st_mtime_ns])
        else:
            files.append([name])
    return [files, trust_remote_code]


def auto_tokenizer(path: str, trust_remote_code: bool, load: Callable[[], Any]) -> Any:
    """The tokenizer of directory `path`: `load()`'s (AutoTokenizer's) the first time, and the class it
    chose remembered when it is transformers' own (a directory's own code never is); later, that class's
    `from_pretrained`, as AutoTokenizer ends by calling it, without AutoTokenizer's imports."""
    if not os.path.isdir(path):  # whatever AutoTokenizer makes of it (its own error)
        return load()
    loaded = []

    def choose() -> list[str] | None:
        loaded.append(load())
        cls = type(loaded[0])
        return [cls.__module__, cls.__name__] if cls.__module__.startswith("transformers.") else None

    choice = remembered("tokenizer_class", tokenizer_choice_key(path, trust_remote_code), choose)
    if loaded:
        return loaded[0]
    if choice is None:  # the directory's own code: AutoTokenizer again
        return load()
    return getattr(importlib.import_module(choice[0]), choice[1]).from_pretrained(path)
