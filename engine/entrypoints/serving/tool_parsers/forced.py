"""Parsers for the calls a grammar forced (tool_choice "required" or a named function): the output is
JSON, not a model's own format, so these are picked by the request, never by `--tool-call-parser`.

- named: the output is the function's arguments object;
- required: the output is a list of `{"name": ..., "parameters": {...}}` objects (vLLM's shape).
"""

from __future__ import annotations

from xlaserve.entrypoints.serving.tool_parsers.base import Call, Parsed, ToolParser, parse_call_list
from xlaserve.entrypoints.serving.tool_parsers.json_scan import Status, skip_ws


class NamedToolParser(ToolParser):
    name = "named"

    def __init__(self, function_name: str, tokenizer=None):
        super().__init__(tokenizer)
        self.function_name = function_name

    def _parse(self, text: str, final: bool, keep_broken: bool) -> Parsed:
        pos = skip_ws(text, 0)
        if pos == len(text):
            return Parsed([text] if final else [], is_held=not final)
        scan = self.scan_at(text, pos)
        if scan.status is Status.COMPLETE:
            return Parsed([Call(self.function_name, text[pos : scan.end], True), text[scan.end :]])
        if scan.status is Status.PARTIAL and not final:
            return Parsed([Call(self.function_name, text[pos:], False)])
        if keep_broken and text[pos] == "{":
            return Parsed([Call(self.function_name, text[pos : scan.end], False), text[scan.end :]])
        return Parsed([text])


class RequiredToolParser(ToolParser):
    name = "required"

    def _parse(self, text: str, final: bool, keep_broken: bool) -> Parsed:
        return parse_call_list(text, skip_ws(text, 0), final, keep_broken, self.scan_at)
