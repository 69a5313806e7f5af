"""Hermes' format, used by Qwen2.5, Qwen3, Hermes and others: each call is a JSON object between
`<tool_call>` and `</tool_call>`, after optional text:

    Let me look.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

from xlaserve.entrypoints.openai.tool_parsers.base import Parsed, ToolParser, held_suffix, read_call_object
from xlaserve.entrypoints.openai.tool_parsers.json_scan import Status, skip_ws


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
            read = read_call_object(text, body)
            if read.status is Status.COMPLETE:
                pieces.append(read.call)
                pos = skip_ws(text, read.end)
                if text.startswith(self.end_tag, pos):
                    pos += len(self.end_tag)
                elif not final and self.end_tag.startswith(text[pos:]) and pos < len(text):
                    return Parsed(pieces, is_held=True)  # maybe the end tag: it is part of the call
                continue
            if read.status is Status.PARTIAL and not final:  # still being written
                if read.call is not None:
                    pieces.append(read.call)
                return Parsed(pieces, is_held=read.call is None)
            # broken (or cut off by the end of the text)
            if keep_broken and read.call is not None:
                pieces.append(read.call)
                pos = read.end
            else:  # the start tag was just text
                pieces.append(text[start : start + len(self.start_tag)])
                pos = start + len(self.start_tag)
