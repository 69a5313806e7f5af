"""Tool-call parsers: a model's text -> OpenAI tool calls, one-shot or streamed (see base.py).

`get_tool_parser(name)` gives a parser's class (vLLM's `--tool-call-parser` names); instantiate one
per choice, since it keeps the stream's state. `default_tool_parser(family_or_hf_config)` names the
parser a model family writes, or None. `NamedToolParser(function_name)` and `RequiredToolParser()` read
the JSON a grammar forced for tool_choice named / "required" (not in the registry).
"""

from __future__ import annotations

from typing import Any

from xlaserve.entrypoints.serving.tool_parsers.base import (
    DeltaFunctionCall,
    DeltaToolCall,
    ExtractedToolCalls,
    FunctionCall,
    ToolCall,
    ToolDelta,
    ToolParser,
    make_tool_call_id,
)
from xlaserve.entrypoints.serving.tool_parsers.deepseek import DeepSeekV3ToolParser, DeepSeekV31ToolParser
from xlaserve.entrypoints.serving.tool_parsers.forced import NamedToolParser, RequiredToolParser
from xlaserve.entrypoints.serving.tool_parsers.glm45 import Glm45ToolParser
from xlaserve.entrypoints.serving.tool_parsers.gpt_oss import OpenAIToolParser
from xlaserve.entrypoints.serving.tool_parsers.granite import GraniteToolParser
from xlaserve.entrypoints.serving.tool_parsers.hermes import HermesToolParser
from xlaserve.entrypoints.serving.tool_parsers.llama3_json import Llama3JsonToolParser
from xlaserve.entrypoints.serving.tool_parsers.minimax_m2 import MiniMaxM2ToolParser
from xlaserve.entrypoints.serving.tool_parsers.mistral import MistralToolParser
from xlaserve.entrypoints.serving.tool_parsers.olmo3 import Olmo3ToolParser
from xlaserve.entrypoints.serving.tool_parsers.phi4_mini import Phi4MiniJsonToolParser
from xlaserve.entrypoints.serving.tool_parsers.pythonic import Llama4PythonicToolParser, PythonicToolParser
from xlaserve.entrypoints.serving.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls
    for cls in (
        HermesToolParser,
        Llama3JsonToolParser,
        MistralToolParser,
        OpenAIToolParser,
        Qwen3CoderToolParser,
        PythonicToolParser,
        DeepSeekV3ToolParser,
        DeepSeekV31ToolParser,
        GraniteToolParser,
        Phi4MiniJsonToolParser,
        Llama4PythonicToolParser,
        Olmo3ToolParser,
        MiniMaxM2ToolParser,
        Glm45ToolParser,
    )
}
# HF model_type -> the format its instruction-tuned models write.
_FAMILY_PARSERS = {
    "qwen2": "hermes",
    "qwen2_moe": "hermes",
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
    "llama": "llama3_json",
    "mistral": "mistral",
    "mixtral": "mistral",
    "gpt_oss": "openai",
    "minimax_m2": "minimax_m2",
    "glm4_moe": "glm45",
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose from {sorted(TOOL_PARSERS)}") from None


def default_tool_parser(model_family_or_hf_config: str | dict[str, Any] | None) -> str | None:
    """The parser for a model family (an HF `model_type`, or an HF config dict), or None."""
    family = model_family_or_hf_config
    if isinstance(family, dict):
        family = family.get("model_type")
    return _FAMILY_PARSERS.get(family) if isinstance(family, str) else None


__all__ = [
    "TOOL_PARSERS",
    "DeltaFunctionCall",
    "DeltaToolCall",
    "ExtractedToolCalls",
    "FunctionCall",
    "NamedToolParser",
    "RequiredToolParser",
    "ToolCall",
    "ToolDelta",
    "ToolParser",
    "default_tool_parser",
    "get_tool_parser",
    "make_tool_call_id",
]
