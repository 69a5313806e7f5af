"""A JSON prefix scanner: how far a model's text is valid JSON, and where the top-level object's members
lie, without waiting for the whole value.

Streaming tool calls needs three answers `json.loads` cannot give: is this text the start of some valid
JSON (so it may still become a call), has the name's string ended (so the call can be announced), and
where do the arguments begin (so they can go out in pieces, as the raw text the model wrote: a prefix of
the final arguments, never re-serialised).
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass, field
from typing import Any

_WS = " \t\n\r"
_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_NUMBER_PREFIX = re.compile(r"-?(?:(?:0|[1-9][0-9]*)(?:\.[0-9]*)?(?:[eE][-+]?[0-9]*)?)?")
_NUMBER_CHARS = frozenset("-+.eE0123456789")
_LITERALS = ("true", "false", "null")
_ESCAPES = frozenset('"\\/bfnrtu')
_HEX = frozenset("0123456789abcdefABCDEF")
# A JSON string's body: unescaped characters, or complete escapes.
_STRING_BODY = re.compile(r'(?:[^"\\\x00-\x1f]+|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*')


class Status(enum.Enum):
    COMPLETE = "complete"  # the value ended at `end`
    PARTIAL = "partial"  # the text ran out: everything so far is a valid prefix
    INVALID = "invalid"  # the text stops being JSON at `end`


@dataclass
class Member:
    """One member of the top-level object: its value's span (end None while the value is open)."""

    key: str
    start: int
    end: int | None = None


@dataclass
class ObjectScan:
    status: Status
    end: int  # COMPLETE: just past the closing brace; INVALID: the offending character; PARTIAL: len(text)
    members: dict[str, Member] = field(default_factory=dict)

    def value_text(self, text: str, key: str) -> str | None:
        """The raw text of a member's value so far (the whole value once it has ended)."""
        member = self.members.get(key)
        if member is None:
            return None
        return text[member.start : member.end if member.end is not None else self.end]

    def is_closed(self, key: str) -> bool:
        member = self.members.get(key)
        return member is not None and member.end is not None


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def scan_object(text: str, pos: int) -> ObjectScan:
    """Scan the JSON object starting at text[pos] (which must be "{"), recording its top-level members."""
    return ObjectScanner(pos).scan(text)


class ObjectScanner:
    """`scan_object` that resumes: streaming re-reads a growing text, and each call scans only what
    was added since the last (a call's arguments can be thousands of characters, read token by token).
    Each `scan(text)` must be given the text of the previous call extended."""

    def __init__(self, pos: int):
        self.pos = pos
        self.i = pos  # where the next token starts
        self.stack: list[str] = []  # "{" or "["
        # value | value_or_close | key | key_or_close | colon | comma_or_close
        self.expect = "value"
        self.current: Member | None = None  # the depth-1 member whose value is being read
        self.members: dict[str, Member] = {}
        self._result: ObjectScan | None = None  # COMPLETE or INVALID: final
        self._seen = ""  # the text up to self.i, to check that each text extends the last
        self._open_string = (-1, -1)  # (start, body read to) of a string the text ended inside

    def scan(self, text: str) -> ObjectScan:
        if self._result is not None:
            return self._result
        if not text.startswith(self._seen):
            raise ValueError("ObjectScanner.scan needs the previous text, extended")
        if self.i == self.pos and self.pos < len(text) and text[self.pos] != "{":
            self._result = ObjectScan(Status.INVALID, self.pos)
            return self._result
        scan = self._run(text)
        if scan.status is not Status.PARTIAL:
            self._result = scan
        self._seen = text[: self.i]
        return scan

    def _run(self, text: str) -> ObjectScan:
        stack, n = self.stack, len(text)
        i, expect, current = self.i, self.expect, self.current
        try:
            while i < n:
                c = text[i]
                if c in _WS:
                    i += 1
                    continue
                if expect == "value_or_close":
                    if c == "]":
                        i = _close(stack, "[", i)
                        current = self._closed(current, i)
                        expect = "comma_or_close"
                        continue
                    expect = "value"
                if expect == "key_or_close":
                    if c == "}":
                        i = _close(stack, "{", i)
                        if not stack:
                            return ObjectScan(Status.COMPLETE, i, self.members)
                        current = self._closed(current, i)
                        expect = "comma_or_close"
                        continue
                    expect = "key"
                if expect == "key":
                    if c != '"':
                        return ObjectScan(Status.INVALID, i, self.members)
                    end, bad = self._string_end(text, i)
                    if end < 0:
                        return _stopped(bad, n, self.members)
                    if len(stack) == 1:
                        current = Member(json.loads(text[i:end]), -1)
                    i, expect = end, "colon"
                    continue
                if expect == "colon":
                    if c != ":":
                        return ObjectScan(Status.INVALID, i, self.members)
                    i, expect = i + 1, "value"
                    continue
                if expect == "value":
                    if len(stack) == 1 and current is not None and current.start < 0:
                        current.start = i
                        self.members.setdefault(current.key, current)
                    if c in "{[":
                        stack.append(c)
                        i += 1
                        expect = "key_or_close" if c == "{" else "value_or_close"
                        continue
                    if c == '"':
                        end, bad = self._string_end(text, i)
                    elif c in _NUMBER_CHARS or c in "tfn":
                        end, bad = _scalar_end(text, i)
                    else:
                        end, bad = -1, i
                    if end < 0:
                        return _stopped(bad, n, self.members)
                    i = end
                    current = self._closed(current, i)
                    expect = "comma_or_close"
                    continue
                # comma_or_close
                top = stack[-1]
                if c == ",":
                    i, expect = i + 1, "key" if top == "{" else "value"
                    continue
                if c in "}]" and (c == "}") == (top == "{"):
                    i = _close(stack, top, i)
                    if not stack:
                        return ObjectScan(Status.COMPLETE, i, self.members)
                    current = self._closed(current, i)
                    continue
                return ObjectScan(Status.INVALID, i, self.members)
            return ObjectScan(Status.PARTIAL, n, self.members)
        finally:  # a partial token is read again next time: i is where it starts
            self.i, self.expect, self.current = i, expect, current

    def _string_end(self, text: str, i: int) -> tuple[int, int]:
        """`_string_end`, going on from where the last text's read of this string stopped."""
        start, body_end = self._open_string
        end, bad, body_end = _string_end(text, i, body_end if start == i else -1)
        self._open_string = (i, body_end)
        return end, bad

    def _closed(self, current: Member | None, i: int) -> Member | None:
        """A value ended at i; at depth 1 it is the current member's."""
        if len(self.stack) == 1 and current is not None and current.start >= 0:
            current.end = i
            return None
        return current


def _stopped(bad: int, n: int, members: dict[str, Member]) -> ObjectScan:
    """The scan of a text that ran out (bad < 0) or broke at `bad`."""
    if bad < 0:
        return ObjectScan(Status.PARTIAL, n, members)
    return ObjectScan(Status.INVALID, bad, members)


def _close(stack: list[str], opener: str, i: int) -> int:
    assert stack[-1] == opener
    stack.pop()
    return i + 1


def _string_end(text: str, i: int, body_from: int = -1) -> tuple[int, int, int]:
    """(end, bad, body_end) for the string starting at text[i] == '"': end is past its closing quote,
    or -1 when the text ends inside it; bad is the first character that cannot be JSON (-1: none);
    body_end is how far its body holds only characters and complete escapes. `body_from`: the body_end
    an earlier, shorter text gave (the body is read on from there)."""
    n = len(text)
    j = _STRING_BODY.match(text, max(i + 1, body_from)).end()
    if j == n:
        return -1, -1, j
    if text[j] == '"':
        return j + 1, -1, j
    if text[j] != "\\":  # a control character: it must be escaped
        return -1, j, j
    # an escape the body did not take: cut off by the end of the text, or invalid
    if j + 1 == n:
        return -1, -1, j
    if text[j + 1] != "u":
        return -1, j + 1, j
    for k in range(j + 2, min(j + 6, n)):
        if text[k] not in _HEX:
            return -1, k, j
    return -1, -1, j


def _scalar_end(text: str, i: int) -> tuple[int, int]:
    """(end, bad) of the number or literal at text[i], as `_string_end` reports them."""
    n = len(text)
    if text[i] in "tfn":
        literal = next(word for word in _LITERALS if word[0] == text[i])
        for k, expected in enumerate(literal):
            if i + k >= n:
                return -1, -1
            if text[i + k] != expected:
                return -1, i + k
        return i + len(literal), -1
    j = i
    while j < n and text[j] in _NUMBER_CHARS:
        j += 1
    valid_to = _NUMBER_PREFIX.match(text, i, j).end()
    if valid_to < j:
        return -1, valid_to
    if j == n:
        return -1, -1
    return (j, -1) if _NUMBER.fullmatch(text, i, j) else (-1, j)


def client_json(text: str) -> tuple[bool, Any]:
    """(True, value) when `text` is JSON a client can read back: no NaN, Infinity or overflowing number."""

    def refuse(constant: str):
        raise ValueError(constant)

    try:
        value = json.loads(text, parse_constant=refuse)
        json.dumps(value, allow_nan=False)  # 1e999 parses as inf
    except (ValueError, RecursionError):
        return False, None
    return True, value
