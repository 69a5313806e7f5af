"""Phi-4-mini's tool calls (vLLM's `phi4_mini_json`): a JSON list of calls right after the word
`functools`, after optional text:

    functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]

`functools` not followed by a list of calls (Python's module, named in a sentence) is content. vLLM's
parser drops the text around the calls and does not stream them; here the text before and after is
content and the calls stream, as in every other parser.
"""

from __future__ import annotations

from xlaserve.entrypoints.serving.tool_parsers.base import Parsed, ToolParser, parse_tagged, read_call_list


class Phi4MiniJsonToolParser(ToolParser):
    name = "phi4_mini_json"
    start_tag = "functools"

    def _parse(self, text: str, final: bool, keep_broken: bool) -> Parsed:
        return parse_tagged(text, self.start_tag, final, keep_broken, self._read_block)

    def _read_block(self, text, pos, final, keep_broken, pieces) -> tuple[int, bool]:
        if pos == len(text):
            return (len(text), True) if not final else (-1, False)
        if text[pos] != "[":
            return -1, False
        return read_call_list(text, pos, final, keep_broken, pieces, self.scan_at)
