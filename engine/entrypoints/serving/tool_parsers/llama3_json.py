"""Llama 3.1/3.2's JSON tool calls: the whole answer is one or more JSON objects (separated by ";"),
optionally after `<|python_tag|>`:

    {"name": "get_weather", "parameters": {"city": "Paris"}}

An answer that does not start with "{" (after whitespace and the tag) is plain content, as in vLLM.
"""

from __future__ import annotations

from xlaserve.entrypoints.serving.tool_parsers.base import Parsed, ToolParser, read_call_object
from xlaserve.entrypoints.serving.tool_parsers.json_scan import Status, skip_ws


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    python_tag = "<|python_tag|>"
    separator = ";"
    keeps_special_tokens = True  # <|python_tag|> is a special token

    def _parse(self, text: str, final: bool, keep_broken: bool) -> Parsed:
        pos = skip_ws(text, 0)
        if text.startswith(self.python_tag, pos):
            pos = skip_ws(text, pos + len(self.python_tag))
        elif not final and pos < len(text) and self.python_tag.startswith(text[pos:]):
            return Parsed([], is_held=True)
        if pos == len(text):
            return Parsed([] if not final else [text], is_held=not final)
        if text[pos] != "{":
            return Parsed([text])
        pieces = []
        while True:
            read = read_call_object(text, pos, self.scan_at)
            if read.status is Status.COMPLETE:
                pieces.append(read.call)
                pos = skip_ws(text, read.end)
                if text.startswith(self.separator, pos):
                    after = skip_ws(text, pos + 1)
                    if after < len(text) and text[after] == "{":
                        pos = after
                        continue
                    if after == len(text):  # a separator at the end belongs to the calls
                        return Parsed(pieces, is_held=not final)
                pieces.append(text[pos:])
                return Parsed(pieces)
            if read.status is Status.PARTIAL and not final:
                if read.call is not None:
                    pieces.append(read.call)
                return Parsed(pieces, is_held=read.call is None)
            if keep_broken and read.call is not None:
                pieces.append(read.call)
                pieces.append(text[read.end :])
                return Parsed(pieces)
            if not pieces:  # not a call after all: the whole answer is content
                return Parsed([text])
            pieces.append(text[pos:])
            return Parsed(pieces)
