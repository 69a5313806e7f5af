"""OLMo 3's tool calls (vLLM's `olmo3`): Python-style calls, one a line, between `<function_calls>` and
`</function_calls>`, after optional text:

    <function_calls>get_weather(city='Paris', days=3)
    get_time(tz='Europe/Paris', h24=true)</function_calls>

The calls are read as `pythonic`'s (literals only, never evaluated), with JSON's null, true and false
allowed as values (the model reads its tools as JSON). A missing `</function_calls>` at the very end
(the model stopped) does not undo whole calls; text after the block is content. The tags are read as
text (special tokens are not kept for them, as in vLLM; OLMo 3's thinking tags are text too). vLLM's
one-shot parse drops the text around the block and its stream only reads an answer that starts with
the tag; here the text around the block is content in both.
"""

from __future__ import annotations

from xlaserve.entrypoints.serving.tool_parsers.base import (
    Call,
    Parsed,
    ToolParser,
    is_start_of,
    parse_tagged,
)
from xlaserve.entrypoints.serving.tool_parsers.json_scan import Status, skip_ws
from xlaserve.entrypoints.serving.tool_parsers.pythonic import put_calls, read_call


class Olmo3ToolParser(ToolParser):
    name = "olmo3"
    start_tag = "<function_calls>"
    end_tag = "</function_calls>"

    def _parse(self, text: str, final: bool, keep_broken: bool) -> Parsed:
        return parse_tagged(text, self.start_tag, final, keep_broken, self._read_block)

    def _read_block(self, text, pos, final, keep_broken, pieces) -> tuple[int, bool]:
        calls: list[Call] = []
        end, status = self._read_calls(text, pos, final, calls)
        return put_calls(calls, end, status, final, keep_broken, pieces)

    def _read_calls(self, text: str, pos: int, final: bool, calls: list[Call]) -> tuple[int, Status]:
        """The block's calls, each on its own line (or after a ","), up to the end tag."""
        while True:
            end, status = read_call(text, skip_ws(text, pos), calls, json_names=True)
            if status is not Status.COMPLETE:
                return end, status
            pos = skip_ws(text, end)
            if text.startswith(self.end_tag, pos):
                return pos + len(self.end_tag), Status.COMPLETE
            if is_start_of(text, pos, (self.end_tag,)):  # the end tag, being written or never written
                return len(text), Status.COMPLETE if final else Status.PARTIAL
            if text[pos] == ",":
                pos += 1
            elif "\n" not in text[end:pos]:
                return pos, Status.INVALID
