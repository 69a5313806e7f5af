"""Texts to compare two tokenizers on (the GGUF tokenizer tests): spaces, lines, scripts, bytes, and
random mixes of pieces and characters."""

from __future__ import annotations

import random

SAMPLES = [
    "",
    " ",
    "  ",
    "   leading spaces",
    "trailing space ",
    "many     spaces     between",
    "Hello world",
    "The lighthouse keeper rose before dawn.",
    "the the the",
    "\n",
    "line1\nline2\n\nline4\r\nwindows",
    "\ttab\tseparated\t",
    "Größe café naïve über résumé",
    "日本 東京 日本語のテキスト",
    "emoji 😀 👍🏽 🇫🇷 👨‍👩‍👧",
    "Ω ∑ ∫ √ ∞ ≠",
    "combining: e\u0301 a\u0308",
    "▁ a literal lower one-eighth block ▁▁",
    "0 12 345 6789 3.14159 -42",
    "x" * 60,
]
# Unicode blocks random texts draw from: ASCII, Latin, Cyrillic, CJK, emoji.
SCRIPT_RANGES = [(0x20, 0x7E), (0xA0, 0x24F), (0x400, 0x4FF), (0x4E00, 0x4E40), (0x1F600, 0x1F64F)]


def random_texts(
    count: int, pieces: list[str], ranges=SCRIPT_RANGES, *, max_chars: int = 30, seed: int = 0
) -> list[str]:
    """`count` texts, each at random either up to `max_chars` characters of one of `ranges`, or 2-5
    of `pieces` joined."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        if rng.random() < 0.5:
            lo, hi = rng.choice(ranges)
            out.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, max_chars))))
        else:
            out.append("".join(rng.choice(pieces) for _ in range(rng.randint(2, 5))))
    return out
