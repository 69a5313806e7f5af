"""Python-style tool calls (vLLM's `pythonic`: Llama 3.2's small models, Llama 4, ToolACE): the answer
is a Python list of calls with keyword arguments whose values are literals:

    [get_weather(city="Paris", days=3), get_time(tz='Europe/Paris', opts={"h24": True})]

Read with Python's `ast` (never evaluated): a value is a string, number, True/False/None, or a list or
dict of those; anything else (a name, an expression, a positional argument) means the answer is not
calls, and it is content. An answer that does not start with "[" is content, as in vLLM.
`llama4_pythonic` is the same list, optionally between Llama 4's `<|python_start|>` and `<|python_end|>`.

One bad value makes the whole list content, so the stream holds the list back until its "]" and
then sends each call whole, its arguments `{"key": value, ...}` in json.dumps' spacing: a client never
reads a call the one-shot parse would not return. (vLLM streams a call's values as they are written:
after `[get_weather(city="Paris", days=x` its client holds `{"city": "Paris"`, which is not JSON, and
the parse of the whole text that follows says there was no call.) `read_call` reads one call for any
format that writes them (olmo3's lines too).
"""

from __future__ import annotations

import ast
import json
import re

from xlaserve.entrypoints.serving.tool_parsers.base import Call, Parsed, ToolParser, is_start_of
from xlaserve.entrypoints.serving.tool_parsers.json_scan import Status, skip_ws

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CLOSERS = {"(": ")", "[": "]", "{": "}"}
_JSON_NAMES = {"null": None, "true": True, "false": False}


class _NotLiteral(ValueError):
    pass


def _literal(node: ast.expr, json_names: bool):
    """A value node as JSON data: literals only (vLLM's set, with a sign on numbers); json_names: also
    JSON's null, true and false, which a model that read its tools as JSON may write."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float))):
        return node.value
    if json_names and isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand, json_names)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.List):
        return [_literal(e, json_names) for e in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) for k in node.keys):
        return {k.value: _literal(v, json_names) for k, v in zip(node.keys, node.values, strict=True)}
    raise _NotLiteral(ast.dump(node))


def _value_end(text: str, pos: int) -> tuple[int, Status]:
    """Where the keyword value at text[pos] ends (at the "," or ")" after it); PARTIAL while it runs to
    the text's end, INVALID at a bracket that closes nothing it opened."""
    stack: list[str] = []
    i = pos
    while i < len(text):
        c = text[i]
        if c in "'\"":
            i += 1
            while i < len(text) and text[i] != c:
                i += 2 if text[i] == "\\" else 1
            if i >= len(text):
                return len(text), Status.PARTIAL
        elif c in _CLOSERS:
            stack.append(_CLOSERS[c])
        elif c in ")]}":
            if not stack:
                return (i, Status.COMPLETE) if c == ")" else (i, Status.INVALID)
            if stack.pop() != c:
                return i, Status.INVALID
        elif c == "," and not stack:
            return i, Status.COMPLETE
        i += 1
    return len(text), Status.PARTIAL


def _name_then(text: str, pos: int, mark: str) -> tuple[str | None, int, Status]:
    """An identifier at text[pos] and, after whitespace, `mark` (a call's "(", a keyword's "="): (the
    name, where `mark` is, COMPLETE), or (None, where and how it stopped)."""
    name = _NAME.match(text, pos)
    if name is None or name.end() == len(text):
        return None, *((len(text), Status.PARTIAL) if pos == len(text) or name else (pos, Status.INVALID))
    after = skip_ws(text, name.end())
    if after == len(text):
        return None, len(text), Status.PARTIAL
    if text[after] != mark:
        return None, pos, Status.INVALID
    return name.group(), after, Status.COMPLETE


def read_call(text: str, pos: int, calls: list[Call], json_names: bool = False) -> tuple[int, Status]:
    """Read one `name(key=value, ...)` at text[pos] into `calls` once its ")" is read and every value is
    a literal (before then a later value could still make it no call, so nothing of it is announced):
    (past its ")", COMPLETE), or where it stopped and how. json_names: null/true/false are values."""
    name, paren, status = _name_then(text, pos, "(")
    if name is None:
        return paren, status
    members: dict[str, str] = {}  # keyword -> its JSON member text
    pos = paren + 1
    while True:
        pos = skip_ws(text, pos)
        if pos < len(text) and text[pos] == ")":
            calls.append(Call(name, "{" + ", ".join(members.values()) + "}", True))
            return pos + 1, Status.COMPLETE
        key, equals, status = _name_then(text, pos, "=")
        if key is None:
            return equals, status
        if key in members:
            return pos, Status.INVALID
        value_end, status = _value_end(text, equals + 1)
        if status is not Status.COMPLETE:
            return value_end, status
        try:
            value = _literal(ast.parse(text[equals + 1 : value_end].strip(), mode="eval").body, json_names)
            # allow_nan: 1e999 is inf, which JSON cannot write
            members[key] = f"{json.dumps(key)}: {json.dumps(value, ensure_ascii=False, allow_nan=False)}"
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return pos, Status.INVALID
        pos = value_end + (text[value_end] == ",")


def starts_positional(text: str, pos: int) -> bool:
    """The call `name(...)` at text[pos] opens with a positional argument (neither `key=` nor ")")."""
    name, paren, _ = _name_then(text, pos, "(")
    if name is None:
        return False
    after = skip_ws(text, paren + 1)
    if after == len(text) or text[after] == ")":
        return False
    key, _, status = _name_then(text, after, "=")
    return key is None and status is Status.INVALID


def skip_call(text: str, pos: int) -> tuple[int, Status]:
    """Past the ")" of the call `name(...)` at text[pos], whatever its values (to skip a bad one):
    (there, COMPLETE), or where and how it stopped (INVALID: not a call's shape)."""
    name, pos, status = _name_then(text, pos, "(")
    while name is not None:
        pos, status = _value_end(text, pos + 1)
        if status is not Status.COMPLETE or text[pos] == ")":
            return pos + (status is Status.COMPLETE), status
    return pos, status


def _read_list(text: str, pos: int, calls: list[Call]) -> tuple[int, Status]:
    """Read `[call, ...]` at text[pos] == "[" into `calls`: (where it ends or broke, how)."""
    pos += 1
    while True:
        end, status = read_call(text, skip_ws(text, pos), calls)
        if status is not Status.COMPLETE:
            return end, status
        pos = skip_ws(text, end)
        if pos == len(text):
            return len(text), Status.PARTIAL
        if text[pos] == "]":
            return pos + 1, Status.COMPLETE
        if text[pos] != ",":
            return pos, Status.INVALID
        pos += 1


class PythonicToolParser(ToolParser):
    name = "pythonic"
    start_tag = ""  # before the list, optional (llama4_pythonic's)
    end_tag = ""  # after the list, optional

    def _parse(self, text: str, final: bool, keep_broken: bool) -> Parsed:
        pos = skip_ws(text, 0)
        if self.start_tag and text.startswith(self.start_tag, pos):
            pos = skip_ws(text, pos + len(self.start_tag))
        elif not final and is_start_of(text, pos, (self.start_tag,)):
            return Parsed([], is_held=True)
        if pos == len(text):
            return Parsed([text] if final else [], is_held=not final)
        if text[pos] != "[":
            return Parsed([text])
        calls: list[Call] = []
        end, status = _read_list(text, pos, calls)
        if status is Status.COMPLETE and self.end_tag:
            after = skip_ws(text, end)
            if text.startswith(self.end_tag, after):
                end = after + len(self.end_tag)
            elif not final and is_start_of(text, after, (self.end_tag,)):
                end, status = len(text), Status.PARTIAL  # maybe the end tag: it is part of the calls
        if status is Status.COMPLETE:
            return Parsed([*calls, text[end:]])
        if status is Status.PARTIAL and not final:  # a later value may still make the list content
            return Parsed([], is_held=True)
        return Parsed([text])


class Llama4PythonicToolParser(PythonicToolParser):
    """Llama 4's pythonic calls, sometimes between `<|python_start|>` and `<|python_end|>`."""

    name = "llama4_pythonic"
    start_tag = "<|python_start|>"
    end_tag = "<|python_end|>"
    keeps_special_tokens = True  # the tags are special tokens
