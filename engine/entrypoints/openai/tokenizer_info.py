"""GET /tokenizer_info (vLLM's, behind --enable-tokenizer-info-endpoint): the tokenizer's configuration,
what its tokenizer_config.json says, with the class and the chat template the server renders with.

lm-eval's `local-completions` / `local-chat-completions` read it (with /tokenize and /detokenize) to
tokenize through the server instead of downloading the tokenizer from a hub: its special tokens
(`eos_token`, `bos_token`, `pad_token`) and its `chat_template`. GGUF models have one too: the tokenizer
built from the file's metadata, with the file's template.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict

# Special tokens a client looks for, filled from the tokenizer's special-tokens map when its
# init_kwargs lack them.
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class TokenizerInfoResponse(BaseModel):
    """The tokenizer's configuration (its other keys as tokenizer_config.json names them)."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str


def tokenizer_info(tokenizer, chat_template: str | None) -> dict[str, Any]:
    """`tokenizer`'s configuration as JSON values: its init arguments without the server's file paths
    (`*_file`, `name_or_path`), special tokens as their text, then `tokenizer_class` and the chat
    template (`chat_template`: the server's --chat-template, else the tokenizer's own)."""
    config: dict[str, Any] = {}
    for key, value in (getattr(tokenizer, "init_kwargs", None) or {}).items():
        if key.endswith("_file") or key == "name_or_path":
            continue
        value = _json_value(value)
        if value is not _DROPPED:
            config[key] = value
    special = getattr(tokenizer, "special_tokens_map", None) or {}
    for key in _SPECIAL_TOKENS:
        if config.get(key) is None and isinstance(special.get(key), str):
            config[key] = special[key]
    config["tokenizer_class"] = type(tokenizer).__name__
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template:
        config["chat_template"] = template
    return config


_DROPPED = object()  # a value JSON cannot carry (the backend's own objects): left out


def _json_value(value: Any) -> Any:
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    content = getattr(value, "content", None)  # tokenizers' AddedToken: its text
    if isinstance(content, str):
        return content
    if isinstance(value, dict):
        items = ((str(k), _json_value(v)) for k, v in value.items())
        return {k: v for k, v in items if v is not _DROPPED}
    if isinstance(value, (list, tuple)):
        return [v for v in map(_json_value, value) if v is not _DROPPED]
    return _DROPPED
