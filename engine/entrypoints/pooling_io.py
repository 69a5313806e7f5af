"""What the offline `LLM` and the server share for pooling models: score pairs and cosine scores; and
the server's binary encodings of pooled outputs (vLLM's embed_dtype and endianness).

Plain Python and numpy (the server's front end imports no jax; ml_dtypes is numpy's bfloat16 and fp8).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import ml_dtypes
import numpy as np

# vLLM's embed_dtype names: the values are rounded to the nearest even, as torch's casts round them.
EMBED_DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "fp8_e4m3": ml_dtypes.float8_e4m3fn,
    "fp8_e5m2": ml_dtypes.float8_e5m2,
}


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


def output_bytes(values: np.ndarray, embed_dtype: str = "float32", endianness: str = "native") -> bytes:
    """A pooled output's values (a vector, or one row per token, row after row) as `embed_dtype`'s bytes
    in `endianness` ("native": this host's byte order, as vLLM's)."""
    array = np.asarray(values, np.float32).astype(EMBED_DTYPES[embed_dtype]).reshape(-1)
    if endianness not in ("native", sys.byteorder):
        array = array.view(f"u{array.itemsize}").byteswap()
    return array.tobytes()
