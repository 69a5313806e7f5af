"""OLMo 3's tool calls (vLLM's `olmo3`): Python-style calls, one a line, between `<function_calls>` and
`</function_calls>`, after optional text:

    <function_calls>get_weather(city='Paris', days=3)
    get_time(tz='Europe/Paris', h24=true)</function_calls>

The calls are read as `pythonic`'s (literals only, never evaluated), with JSON's null, true and false
allowed as values (the model reads its tools as JSON). A missing `</function_calls>` at the very end
(the model stopped) does not undo whole calls; text after the block is content. A call that is not
literals (a name, an expression, inf) is skipped and the others kept, as newer vLLM does; a block of
nothing else is text. The tags are read as text (special tokens are not kept for them, as in vLLM;
OLMo 3's thinking tags are text too). vLLM's one-shot parse drops the text around the block and its
stream only reads an answer that starts with the tag; here the text around the block is content in
both.
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
from xlaserve.entrypoints.serving.tool_parsers.pythonic import put_calls, read_call, skip_call


class Olmo3ToolParser(ToolParser):
    name = "olmo3"
    start_tag = "<function_calls>"
    end_tag = "</function_calls>"

    def _parse(self, text: str, final: bool, keep_broken: bool) -> Parsed:
        return parse_tagged(text, self.start_tag, final, keep_broken, self._read_block)

    def _read_block(self, text, pos, final, keep_broken, pieces) -> tuple[int, bool]:
        calls: list[Call] = []
        end, status = self._read_calls(text, pos, final, keep_broken, calls)
        if status is Status.COMPLETE and not calls:  # every call was bad: the block is text
            return -1, False
        return put_calls(calls, end, status, final, keep_broken, pieces)

    def _read_calls(
        self, text: str, pos: int, final: bool, keep_broken: bool, calls: list[Call]
    ) -> tuple[int, Status]:
        """The block's calls, each on its own line (or after a ","), up to the end tag. A call whose
        values are not literals is skipped (its text is neither call nor content), as vLLM's
        `salvage_tool_calls` skips it; streamed, one already announced keeps what was sent."""
        while True:
            start, read = skip_ws(text, pos), len(calls)
            end, status = read_call(text, start, calls, json_names=True)
            if status is Status.INVALID:
                end, status = skip_call(text, start)
                if status is not Status.COMPLETE:
                    return end, status
                if not keep_broken:
                    del calls[read:]  # the bad call, if it was announced
            elif status is not Status.COMPLETE:
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
