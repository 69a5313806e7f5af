"""DeepSeek's tool calls, a block of calls between special tokens after optional text (one line each in
the text; cut here):

    deepseek_v3 (DeepSeek-V3, R1-0528):
    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

    deepseek_v31 (DeepSeek-V3.1):
    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
    <｜tool▁call▁end｜><｜tool▁calls▁end｜>

The arguments are the JSON object as written (as vLLM passes them on). A call is announced once its
name has ended and its arguments have begun with "{"; a missing `<｜tool▁call▁end｜>` or fence at the very
end (the model stopped) does not undo a whole object. Text after the block is content.
"""

from __future__ import annotations

from xlaserve.entrypoints.serving.tool_parsers.base import (
    Call,
    Parsed,
    ToolParser,
    held_suffix,
    is_start_of,
    parse_tagged,
)
from xlaserve.entrypoints.serving.tool_parsers.json_scan import Status, skip_ws

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
_UNDECIDED, _NOT_A_CALL = -1, -2


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    keeps_special_tokens = True  # the markers are special tokens
    args_open = "```json"  # the fence around the arguments (after the name's line)
    args_close = "```"

    def _parse(self, text: str, final: bool, keep_broken: bool) -> Parsed:
        return parse_tagged(text, CALLS_BEGIN, final, keep_broken, self._read_block)

    def _read_block(self, text, pos, final, keep_broken, pieces) -> tuple[int, bool]:
        """The block's calls up to `<｜tool▁calls▁end｜>`; as `parse_tagged` asks."""
        found = len(pieces)
        while True:
            pos = skip_ws(text, pos)
            if text.startswith(CALL_BEGIN, pos):
                end, is_held = self._read_call(text, pos + len(CALL_BEGIN), final, keep_broken, pieces)
                if is_held:
                    return len(text), True
                if end >= 0:
                    pos = end
                    continue
            elif text.startswith(CALLS_END, pos):
                return pos + len(CALLS_END), False
            elif not final and is_start_of(text, pos, (CALL_BEGIN, CALLS_END)):
                return len(text), True
            # what follows the calls is content; no call read: the marker was text
            return (pos if len(pieces) > found else -1), False

    def _header(self, text: str, pos: int) -> tuple[str | None, int]:
        """The call's name and where its arguments start: (None, _UNDECIDED) while it is being written,
        (None, _NOT_A_CALL) when it is not this format's."""
        sep = text.find(SEP, pos)
        kind = text[pos : len(text) if sep < 0 else sep]
        if "\n" in kind or (sep >= 0 and not kind):
            return None, _NOT_A_CALL
        if sep < 0:
            return None, _UNDECIDED
        name_end = text.find("\n", sep + len(SEP))
        name = text[sep + len(SEP) : len(text) if name_end < 0 else name_end]
        if "<｜" in name or (name_end >= 0 and not name):
            return None, _NOT_A_CALL
        if name_end < 0:
            return None, _UNDECIDED
        fence = name_end + 1
        if not text.startswith(self.args_open, fence):
            rest = text[fence:]
            return (None, _UNDECIDED) if self.args_open.startswith(rest) else (None, _NOT_A_CALL)
        return name, fence + len(self.args_open)

    def _read_call(self, text, pos, final, keep_broken, pieces) -> tuple[int, bool]:
        """One call after its `<｜tool▁call▁begin｜>` into `pieces`: (where the text goes on, or -1 when
        it is not a call; whether the rest is held back)."""
        name, args = self._header(text, pos)
        if name is None:
            return (len(text), True) if args == _UNDECIDED and not final else (-1, False)
        args = skip_ws(text, args)
        if args == len(text):
            return (len(text), True) if not final else (-1, False)
        if text[args] != "{":
            return -1, False
        scan = self.scan_at(text, args)
        if scan.status is Status.PARTIAL and not final:
            pieces.append(Call(name, text[args:], False))
            return len(text), False
        if scan.status is not Status.COMPLETE:
            if keep_broken:  # broken after it was announced: keep what went out, the rest is content
                pieces.append(Call(name, text[args : scan.end], False))
                return scan.end, False
            return -1, False
        pieces.append(Call(name, text[args : scan.end], True))
        pos = scan.end
        for tag in (self.args_close, CALL_END):  # the call's closing, when written
            if not tag:
                continue
            after = skip_ws(text, pos)
            if text.startswith(tag, after):
                pos = after + len(tag)
            elif not final and is_start_of(text, after, (tag,)):
                return len(text), True
            else:
                break
        return pos, False


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    name = "deepseek_v31"
    args_close = ""

    def _header(self, text: str, pos: int) -> tuple[str | None, int]:
        sep = text.find(SEP, pos)
        name = text[pos : len(text) - held_suffix(text, SEP) if sep < 0 else sep]
        if "\n" in name or "<｜" in name or (sep >= 0 and not name):
            return None, _NOT_A_CALL
        return (None, _UNDECIDED) if sep < 0 else (name, sep + len(SEP))
