"""Fixtures shared by the engine-layer tests: SmolLM2's tokenizer and a structured-output manager on it
(a module may define its own `tokenizer`, which takes precedence there)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tokenizer():
    from xlaserve.models.loader import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="module")
def manager(tokenizer):
    from xlaserve.engine.structured_output import StructuredOutputManager

    manager = StructuredOutputManager(tokenizer, 49152, tokenizer.eos_token_id)
    yield manager
    manager.shutdown()
