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

_WS = " \t\n\r"
_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_NUMBER_PREFIX = re.compile(r"-?(?:(?:0|[1-9][0-9]*)(?:\.[0-9]*)?(?:[eE][-+]?[0-9]*)?)?")
_NUMBER_CHARS = frozenset("-+.eE0123456789")
_LITERALS = ("true", "false", "null")
_ESCAPES = frozenset('"\\/bfnrtu')
_HEX = frozenset("0123456789abcdefABCDEF")


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
    scan = ObjectScan(Status.PARTIAL, len(text))
    if pos >= len(text):
        return scan
    if text[pos] != "{":
        return ObjectScan(Status.INVALID, pos)
    stack: list[str] = []  # "{" or "["
    expect = "value"  # value | key_or_close | key | colon | comma_or_close
    key_start = -1
    current: Member | None = None  # the depth-1 member whose value is being read
    i = pos
    n = len(text)
    while i < n:
        c = text[i]
        if c in _WS:
            i += 1
            continue
        if expect in ("value", "key", "key_or_close"):
            if expect == "key_or_close" and c == "}":
                i = _close(stack, "{", i)
                if len(stack) == 0:
                    return ObjectScan(Status.COMPLETE, i, scan.members)
                if len(stack) == 1 and current is not None:
                    current.end = i
                    current = None
                expect = "comma_or_close"
                continue
            if expect in ("key", "key_or_close"):
                if c != '"':
                    return ObjectScan(Status.INVALID, i, scan.members)
                key_start = i
            if c == '"':
                end, bad = _string_end(text, i)
                if end < 0:
                    return _stopped(bad, n, scan)
                if expect != "value":
                    expect = "colon"
                    if len(stack) == 1:
                        current = Member(json.loads(text[key_start:end]), -1)
                    i = end
                    continue
                i = end
            elif c in "{[":
                if len(stack) == 1 and current is not None:
                    current.start = i
                    scan.members.setdefault(current.key, current)
                stack.append(c)
                expect = "key_or_close" if c == "{" else "value_or_close"
                i += 1
                if expect == "value_or_close":
                    j = skip_ws(text, i)
                    if j < n and text[j] == "]":
                        i = _close(stack, "[", j)
                        expect = "comma_or_close"
                        if len(stack) == 1 and current is not None:
                            current.end = i
                            current = None
                    else:
                        expect = "value"
                        i = j
                continue
            elif c in _NUMBER_CHARS or c in "tfn":
                end, bad = _scalar_end(text, i)
                if end < 0:
                    return _stopped(bad, n, scan)
                i = end
            else:
                return ObjectScan(Status.INVALID, i, scan.members)
            expect = "comma_or_close"
            continue
        if expect == "colon":
            if c != ":":
                return ObjectScan(Status.INVALID, i, scan.members)
            i = skip_ws(text, i + 1)
            if len(stack) == 1 and current is not None:
                current.start = i
                scan.members.setdefault(current.key, current)
                if i < n and text[i] not in "{[":
                    # a scalar value at depth 1: find its end now, so its span is known
                    if text[i] == '"':
                        end, bad = _string_end(text, i)
                    elif text[i] in _NUMBER_CHARS or text[i] in "tfn":
                        end, bad = _scalar_end(text, i)
                    else:
                        end, bad = -1, i
                    if end < 0:
                        return _stopped(bad, n, scan)
                    current.end = end
                    current = None
                    i = end
                    expect = "comma_or_close"
                    continue
            expect = "value"
            continue
        if expect == "comma_or_close":
            top = stack[-1]
            if c == ",":
                expect = "key" if top == "{" else "value"
                i += 1
                continue
            if c in "}]":
                if (c == "}") != (top == "{"):
                    return ObjectScan(Status.INVALID, i, scan.members)
                i = _close(stack, top, i)
                if not stack:
                    return ObjectScan(Status.COMPLETE, i, scan.members)
                if len(stack) == 1 and current is not None:
                    current.end = i
                    current = None
                continue
            return ObjectScan(Status.INVALID, i, scan.members)
        raise AssertionError(expect)
    return scan


def _stopped(bad: int, n: int, scan: ObjectScan) -> ObjectScan:
    """The scan of a text that ran out (bad < 0) or broke at `bad`."""
    if bad < 0:
        return ObjectScan(Status.PARTIAL, n, scan.members)
    return ObjectScan(Status.INVALID, bad, scan.members)


def _close(stack: list[str], opener: str, i: int) -> int:
    assert stack[-1] == opener
    stack.pop()
    return i + 1


def _string_end(text: str, i: int) -> tuple[int, int]:
    """(end, bad) for the string starting at text[i] == '"': end is past its closing quote, or -1 when
    the text ends inside it; bad is the first character that cannot be JSON (-1: none)."""
    n = len(text)
    j = i + 1
    while j < n:
        c = text[j]
        if c == '"':
            return j + 1, -1
        if c == "\\":
            if j + 1 >= n:
                return -1, -1
            if text[j + 1] not in _ESCAPES:
                return -1, j + 1
            if text[j + 1] == "u":
                for k in range(j + 2, min(j + 6, n)):
                    if text[k] not in _HEX:
                        return -1, k
                if j + 6 > n:
                    return -1, -1
                j += 6
                continue
            j += 2
            continue
        if ord(c) < 0x20:  # control characters must be escaped
            return -1, j
        j += 1
    return -1, -1


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
