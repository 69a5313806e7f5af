"""A model's tokenizer without its weights, in any form `--model` takes: what the server's front end
loads (AsyncLLM), and what the loaders attach to a checkpoint.

No jax, flax or model code, transitively (tests/engine/test_front_end_imports.py): the front end
imports this module and nothing else of models/.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from xlaserve.models.gguf_tokenizer import load_gguf_tokenizer
from xlaserve.models.model_path import is_orbax_checkpoint, resolve_model_path
from xlaserve.models.transformers_memo import auto_tokenizer


def load_tokenizer(model: str | None, *, trust_remote_code: bool = False) -> PreTrainedTokenizerFast:
    """The tokenizer of `model` (any form `load_checkpoint` takes) without reading its weights."""
    path = resolve_model_path(model)
    if path.endswith(".gguf"):
        return load_gguf_tokenizer(path)
    return directory_tokenizer(path, trust_remote_code=trust_remote_code)


def directory_tokenizer(path: str, *, trust_remote_code: bool = False) -> PreTrainedTokenizerFast:
    """The tokenizer files of a model directory; ValueError naming the directory when it has none.
    `trust_remote_code` (vLLM's flag): transformers may import the Python files the directory ships for
    its tokenizer class (tokenizer_config.json's auto_map); without it such a directory is refused."""
    if is_orbax_checkpoint(path):
        # `convert` saved a fast tokenizer: tokenizer.json says everything, and reading it directly
        # skips AutoTokenizer's config resolution (which imports torch when installed: seconds).
        try:
            return PreTrainedTokenizerFast.from_pretrained(path)
        except (OSError, ValueError, TypeError):
            pass

    def load():
        # Imported here, not above: transformers' auto classes import torch when installed (seconds),
        # which a GGUF or converted model never needs, nor a directory whose class is remembered.
        from transformers import AutoTokenizer

        # False, not None, when not trusted: None would have transformers prompt on a terminal for 15 s.
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)

    try:
        return auto_tokenizer(path, trust_remote_code, load)
    except (OSError, ValueError, TypeError) as e:
        if not trust_remote_code and "trust_remote_code=True" in str(e):
            raise ValueError(
                f"the tokenizer of {path!r} is Python code the directory ships (tokenizer_config.json's "
                "auto_map): --trust-remote-code (LLM(trust_remote_code=True)) lets it run"
            ) from e
        raise ValueError(
            f"{path!r} has no usable tokenizer (tokenizer.json / tokenizer_config.json): {e}; "
            "without one, load it with skip_tokenizer_init=True and pass prompt_token_ids"
        ) from e
