"""Granite 3.x's tool calls (vLLM's `granite`): the answer is a JSON list of calls, after
`<|tool_call|>` (Granite 3.0's special token) or `<tool_call>` (Granite 3.1's text):

    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]

An answer that is not such a list (after whitespace and the tag) is content, as in vLLM.
"""

from __future__ import annotations

from xlaserve.entrypoints.serving.tool_parsers.base import Parsed, ToolParser, read_call_list
from xlaserve.entrypoints.serving.tool_parsers.json_scan import skip_ws


class GraniteToolParser(ToolParser):
    name = "granite"
    tags = ("<|tool_call|>", "<tool_call>")
    keeps_special_tokens = True  # <|tool_call|> is a special token

    def _parse(self, text: str, final: bool, keep_broken: bool) -> Parsed:
        pos = skip_ws(text, 0)
        for tag in self.tags:
            if text.startswith(tag, pos):
                pos = skip_ws(text, pos + len(tag))
                break
            if not final and pos < len(text) and tag.startswith(text[pos:]):
                return Parsed([], is_held=True)
        if pos == len(text):
            return Parsed([text] if final else [], is_held=not final)
        if text[pos] != "[":
            return Parsed([text])
        pieces: list = []
        end, is_held = read_call_list(text, pos, final, keep_broken, pieces, self.scan_at)
        if end < 0:
            return Parsed([text])
        return Parsed(pieces if is_held else [*pieces, text[end:]], is_held=is_held)
