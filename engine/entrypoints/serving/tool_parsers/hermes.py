"""Hermes' format, used by Qwen2.5, Qwen3, Hermes and others: each call is a JSON object between
`<tool_call>` and `</tool_call>`, after optional text:

    Let me look.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A JSON list of such objects between the tags (SmolLM2's form) is read as that many calls.
"""

from __future__ import annotations

from xlaserve.entrypoints.serving.tool_parsers.base import (
    Parsed,
    ToolParser,
    parse_tagged,
    read_call_list,
    read_call_object,
)
from xlaserve.entrypoints.serving.tool_parsers.json_scan import Status, skip_ws


class HermesToolParser(ToolParser):
    name = "hermes"
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def _parse(self, text: str, final: bool, keep_broken: bool) -> Parsed:
        return parse_tagged(text, self.start_tag, final, keep_broken, self._read_block)

    def _read_block(self, text, pos, final, keep_broken, pieces) -> tuple[int, bool]:
        """The call object, or list of them, after a start tag, and its end tag; as `parse_tagged` asks."""
        pos = skip_ws(text, pos)
        if pos < len(text) and text[pos] == "[":
            end, is_held = read_call_list(text, pos, final, keep_broken, pieces, self.scan_at)
        else:
            end, is_held = self._read_object(text, pos, final, keep_broken, pieces)
        if is_held or end < 0:
            return end, is_held
        end = skip_ws(text, end)
        if text.startswith(self.end_tag, end):
            return end + len(self.end_tag), False
        if not final and end < len(text) and self.end_tag.startswith(text[end:]):
            return len(text), True  # maybe the end tag: it is part of the call
        return end, False

    def _read_object(self, text, pos, final, keep_broken, pieces) -> tuple[int, bool]:
        """One call object; as `read_call_list`."""
        read = read_call_object(text, pos, self.scan_at)
        if read.status is Status.COMPLETE:
            pieces.append(read.call)
            return read.end, False
        if read.status is Status.PARTIAL and not final:  # still being written
            if read.call is not None:
                pieces.append(read.call)
            return len(text), read.call is None
        if keep_broken and read.call is not None:  # broken after it was announced
            pieces.append(read.call)
            return read.end, False
        return -1, False
