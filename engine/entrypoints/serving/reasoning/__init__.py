"""Reasoning parsers (vLLM's `--reasoning-parser` names): split thinking from the answer."""

from __future__ import annotations

from xlaserve.entrypoints.serving.reasoning.base import (
    DeepSeekR1ReasoningParser,
    DeepSeekV3ReasoningParser,
    Glm45ReasoningParser,
    MistralReasoningParser,
    Olmo3ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningDelta,
    ReasoningParser,
)
from xlaserve.entrypoints.serving.reasoning.granite import GraniteReasoningParser
from xlaserve.entrypoints.serving.reasoning.harmony import GptOssReasoningParser
from xlaserve.entrypoints.serving.reasoning.minimax import (
    MiniMaxM2AppendThinkReasoningParser,
    MiniMaxM2ReasoningParser,
)

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls
    for cls in (
        DeepSeekR1ReasoningParser,
        DeepSeekV3ReasoningParser,
        Qwen3ReasoningParser,
        GptOssReasoningParser,
        GraniteReasoningParser,
        MistralReasoningParser,
        Olmo3ReasoningParser,
        MiniMaxM2ReasoningParser,
        MiniMaxM2AppendThinkReasoningParser,
        Glm45ReasoningParser,
    )
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose from {sorted(REASONING_PARSERS)}"
        ) from None


__all__ = ["REASONING_PARSERS", "ReasoningDelta", "ReasoningParser", "get_reasoning_parser"]
