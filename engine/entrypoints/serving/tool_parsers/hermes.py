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
    held_suffix,
    read_call_list,
    read_call_object,
)
from xlaserve.entrypoints.serving.tool_parsers.json_scan import Status, skip_ws


class HermesToolParser(ToolParser):
    name = "hermes"
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def _parse(self, text: str, final: bool, keep_broken: bool) -> Parsed:
        pieces = []
        pos = 0
        while True:
            start = text.find(self.start_tag, pos)
            if start < 0:
                held = 0 if final else held_suffix(text, self.start_tag)
                pieces.append(text[pos : len(text) - held])
                return Parsed(pieces, is_held=held > 0)
            pieces.append(text[pos:start])
            body = skip_ws(text, start + len(self.start_tag))
            if body < len(text) and text[body] == "[":
                end, is_held = read_call_list(text, body, final, keep_broken, pieces, self.scan_at)
            else:
                end, is_held = self._read_object(text, body, final, keep_broken, pieces)
            if is_held:
                return Parsed(pieces, is_held=True)
            if end < 0:  # the start tag was just text
                pieces.append(text[start : start + len(self.start_tag)])
                pos = start + len(self.start_tag)
                continue
            pos = skip_ws(text, end)
            if text.startswith(self.end_tag, pos):
                pos += len(self.end_tag)
            elif not final and pos < len(text) and self.end_tag.startswith(text[pos:]):
                return Parsed(pieces, is_held=True)  # maybe the end tag: it is part of the call

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
