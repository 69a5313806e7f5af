"""Mistral's tool calls, after the `[TOOL_CALLS]` special token, in either of its tokenizers' forms:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]      (v3 and earlier)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}                             (v11 and later)

Text before the token is content. Mistral's templates want call ids of 9 letters and digits.
"""

from __future__ import annotations

import re
import secrets
import string

from xlaserve.entrypoints.serving.tool_parsers.base import (
    Call,
    Parsed,
    ToolParser,
    held_suffix,
    read_call_list,
)
from xlaserve.entrypoints.serving.tool_parsers.json_scan import Status, skip_ws

_NAME_CHAR = re.compile(r"[A-Za-z0-9_.\-]")
_ID_CHARS = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    name = "mistral"
    start_tag = "[TOOL_CALLS]"
    args_tag = "[ARGS]"
    keeps_special_tokens = True  # [TOOL_CALLS] is a special token

    def new_call_id(self) -> str:
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))

    def _parse(self, text: str, final: bool, keep_broken: bool) -> Parsed:
        pieces: list = []
        pos = 0
        while True:
            start = text.find(self.start_tag, pos)
            if start < 0:
                held = 0 if final else held_suffix(text, self.start_tag)
                pieces.append(text[pos : len(text) - held])
                return Parsed(pieces, is_held=held > 0)
            pieces.append(text[pos:start])
            body = skip_ws(text, start + len(self.start_tag))
            if body == len(text):
                if final:
                    pieces.append(text[start:])
                return Parsed(pieces, is_held=not final)
            if text[body] == "[":
                pos, is_held = read_call_list(text, body, final, keep_broken, pieces, self.scan_at)
            else:
                pos, is_held = self._read_named(text, body, final, keep_broken, pieces)
            if is_held:
                return Parsed(pieces, is_held=True)
            if pos < 0:  # not calls after all: the tag was just text
                pieces.append(text[start : start + len(self.start_tag)])
                pos = start + len(self.start_tag)

    def _read_named(self, text, pos, final, keep_broken, pieces) -> tuple[int, bool]:
        """The `name[ARGS]{...}` form; as `read_call_list`."""
        name_end = pos
        while name_end < len(text) and _NAME_CHAR.match(text, name_end):
            name_end += 1
        rest = text[name_end:]
        if not rest.startswith(self.args_tag):
            if not final and name_end + len(rest) == len(text) and self.args_tag.startswith(rest):
                return len(text), True  # the name or the [ARGS] tag is still being written
            return -1, False
        if name_end == pos:
            return -1, False
        name = text[pos:name_end]
        args = skip_ws(text, name_end + len(self.args_tag))
        if args == len(text):
            return (len(text), True) if not final else (-1, False)
        scan = self.scan_at(text, args)
        raw = text[args : scan.end]
        if scan.status is Status.COMPLETE:
            pieces.append(Call(name, raw, True))
            return scan.end, False
        if scan.status is Status.PARTIAL and not final:
            pieces.append(Call(name, raw, False))
            return len(text), False
        if keep_broken and text[args] == "{":
            pieces.append(Call(name, raw, False))
            return scan.end, False
        return -1, False
