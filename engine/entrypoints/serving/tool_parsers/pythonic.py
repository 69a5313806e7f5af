"""Python-style tool calls (vLLM's `pythonic`: Llama 3.2's small models, Llama 4, ToolACE): the answer
is a Python list of calls with keyword arguments whose values are literals:

    [get_weather(city="Paris", days=3), get_time(tz='Europe/Paris', opts={"h24": True})]

Read with Python's `ast` (never evaluated): a value is a string, number, True/False/None, or a list or
dict of those; anything else (a name, an expression, a positional argument) means the answer is not
calls, and it is content. An answer that does not start with "[" is content, as in vLLM.

A call is announced once its name and "(" are written; its arguments grow one whole keyword at a time
(a value is only known to be a literal when it has ended), as `{"key": value, ...}` in json.dumps'
spacing.
"""

from __future__ import annotations

import ast
import json
import re

from xlaserve.entrypoints.serving.tool_parsers.base import Call, Parsed, ToolParser
from xlaserve.entrypoints.serving.tool_parsers.json_scan import Status, skip_ws

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CLOSERS = {"(": ")", "[": "]", "{": "}"}


class _NotLiteral(ValueError):
    pass


def _literal(node: ast.expr):
    """A value node as JSON data: literals only (vLLM's set, with a sign on numbers)."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float))):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) for k in node.keys):
        return {k.value: _literal(v) for k, v in zip(node.keys, node.values, strict=True)}
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


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def _parse(self, text: str, final: bool, keep_broken: bool) -> Parsed:
        pos = skip_ws(text, 0)
        if pos == len(text):
            return Parsed([text] if final else [], is_held=not final)
        if text[pos] != "[":
            return Parsed([text])
        calls: list[Call] = []
        end, status = _read_calls(text, pos, calls)
        if status is Status.COMPLETE:
            return Parsed([*calls, text[end:]])
        if status is Status.PARTIAL and not final:
            return Parsed(calls, is_held=not calls)
        if keep_broken and calls:  # broken after a call went out: keep it, the rest is content
            return Parsed([*calls, text[end:]])
        return Parsed([text])


def _read_calls(text: str, pos: int, calls: list[Call]) -> tuple[int, Status]:
    """Read `[name(key=value, ...), ...]` at text[pos] == "[" into `calls` (announced ones, the last
    maybe unfinished): (where it ends or broke, how)."""
    pos += 1
    while True:
        pos = skip_ws(text, pos)
        name = _NAME.match(text, pos)
        if name is None or name.end() == len(text):
            return (len(text), Status.PARTIAL) if pos == len(text) or name else (pos, Status.INVALID)
        paren = skip_ws(text, name.end())
        if paren == len(text):
            return len(text), Status.PARTIAL
        if text[paren] != "(":
            return pos, Status.INVALID
        members: list[str] = []
        keys: set[str] = set()
        call = Call(name.group(), "{", False)  # announced at its first keyword or its ")"
        pos = paren + 1
        while True:  # the keywords
            pos = skip_ws(text, pos)
            if pos < len(text) and text[pos] == ")":
                call.arguments, call.is_complete = "{" + ", ".join(members) + "}", True
                if not members:
                    calls.append(call)
                break
            key = _NAME.match(text, pos)
            if key is None or key.end() == len(text):
                return (len(text), Status.PARTIAL) if pos == len(text) or key else (pos, Status.INVALID)
            equals = skip_ws(text, key.end())
            if equals == len(text):
                return len(text), Status.PARTIAL
            if text[equals] != "=" or key.group() in keys:
                return pos, Status.INVALID
            if not members:
                calls.append(call)
            value_end, status = _value_end(text, equals + 1)
            if status is not Status.COMPLETE:
                return value_end, status
            try:
                value = _literal(ast.parse(text[equals + 1 : value_end].strip(), mode="eval").body)
                member = f"{json.dumps(key.group())}: {json.dumps(value, ensure_ascii=False)}"
            except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
                return pos, Status.INVALID
            keys.add(key.group())
            members.append(member)
            call.arguments = "{" + ", ".join(members)
            pos = value_end + (text[value_end] == ",")
        pos = skip_ws(text, pos + 1)
        if pos == len(text):
            return len(text), Status.PARTIAL
        if text[pos] == "]":
            return pos + 1, Status.COMPLETE
        if text[pos] != ",":
            return pos, Status.INVALID
        pos += 1
