"""What the offline `LLM` and the server share for pooling models: score pairs and cosine scores.

Plain Python and numpy (the server's front end imports no jax).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def score_pairs(
    text_1: str | Sequence, text_2: str | Sequence, field_1="text_1", field_2="text_2"
) -> list[tuple]:
    """vLLM's pairing: 1 x 1, 1 x N (the one against each), or N x N (pairwise). Items are strings or
    token id lists; ValueError naming the field otherwise."""
    first = [text_1] if _is_single(text_1) else list(text_1)
    second = [text_2] if _is_single(text_2) else list(text_2)
    if not first:
        raise ValueError(f"{field_1} must not be empty")
    if not second:
        raise ValueError(f"{field_2} must not be empty")
    if len(first) == 1:
        return [(first[0], item) for item in second]
    if len(first) != len(second):
        raise ValueError(
            f"{field_1} has {len(first)} items and {field_2} {len(second)}: give one {field_1}, or as many "
            f"as {field_2}"
        )
    return list(zip(first, second))


def _is_single(value) -> bool:
    """A string, or a token id list (a list of ints)."""
    return isinstance(value, str) or (
        isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, int) for v in value)
    )


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The cosine similarity of two embeddings (an embedding model's score)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-12))


def pair_token_ids(tokenizer, first, second) -> list[int]:
    """A cross-encoder's input: the two texts as the tokenizer pairs them (token id lists are joined)."""
    if isinstance(first, str) and isinstance(second, str):
        return list(tokenizer(first, text_pair=second)["input_ids"])
    ids = [first if not isinstance(first, str) else tokenizer.encode(first)]
    ids.append(second if not isinstance(second, str) else tokenizer.encode(second, add_special_tokens=False))
    return [*ids[0], *ids[1]]
