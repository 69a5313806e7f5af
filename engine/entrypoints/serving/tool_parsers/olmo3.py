"""OLMo 3's tool calls (vLLM's `olmo3`): Python-style calls, one a line, between `<function_calls>` and
`</function_calls>`, after optional text:

    <function_calls>get_weather(city='Paris', days=3)
    get_time(tz='Europe/Paris', h24=true)</function_calls>

The calls are read as `pythonic`'s (literals only, never evaluated), with JSON's null, true and false
allowed as values (the model reads its tools as JSON). A call that is not literals (a name, an
expression, inf, a keyword twice) is skipped and the others kept, as vLLM's newer parser salvages them;
so is a call the end of the text cut off (the model stopped; a missing `</function_calls>` there does
not undo whole calls either); a block of nothing else is text. A first call that opens with a positional
argument (`f(1)`) makes the whole block text, as vLLM's pattern check does (it reads only the first
call's first argument); a later one is skipped like any call that cannot be read (vLLM keeps it with
its positional arguments dropped: a call without what the model wrote). Each call goes out whole once
its ")" is read, so the stream and the one-shot parse agree on which calls there are. The tags are
read as text (special tokens are not kept for them, as in vLLM; OLMo 3's thinking tags are text too).
vLLM's one-shot parse drops the text around the block and its stream only reads an answer that starts
with the tag; here the text around the block is content in both.
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
from xlaserve.entrypoints.serving.tool_parsers.pythonic import read_call, skip_call, starts_positional


class Olmo3ToolParser(ToolParser):
    name = "olmo3"
    start_tag = "<function_calls>"
    end_tag = "</function_calls>"

    def _parse(self, text: str, final: bool, keep_broken: bool) -> Parsed:
        return parse_tagged(text, self.start_tag, final, keep_broken, self._read_block)

    def _read_block(self, text, pos, final, keep_broken, pieces) -> tuple[int, bool]:
        calls: list[Call] = []
        end, status = self._read_calls(text, pos, final, calls)
        if status is Status.PARTIAL:
            pieces += calls
            return end, not calls
        if calls and (status is Status.COMPLETE or keep_broken):  # broken after calls went out: they stay
            pieces += calls
            return end, False
        return -1, False  # not calls: the tag was text

    def _read_calls(self, text: str, pos: int, final: bool, calls: list[Call]) -> tuple[int, Status]:
        """The block's calls, each on its own line (or after a ","), up to the end tag or the text's end.
        A call whose values are not literals is skipped (its text is neither call nor content)."""
        start = skip_ws(text, pos)
        if starts_positional(text, start):
            return start, Status.INVALID
        while True:
            end, status = read_call(text, start, calls, json_names=True)
            if status is Status.INVALID:
                end, status = skip_call(text, start)
                if status is Status.INVALID:
                    return start, status
            if status is Status.PARTIAL:
                return len(text), Status.COMPLETE if final else Status.PARTIAL
            pos = skip_ws(text, end)
            if text.startswith(self.end_tag, pos):
                return pos + len(self.end_tag), Status.COMPLETE
            if is_start_of(text, pos, (self.end_tag,)):  # the end tag, being written or never written
                return len(text), Status.COMPLETE if final else Status.PARTIAL
            if text[pos] == ",":
                pos += 1
            elif "\n" not in text[end:pos]:
                return pos, Status.INVALID
            start = skip_ws(text, pos)
