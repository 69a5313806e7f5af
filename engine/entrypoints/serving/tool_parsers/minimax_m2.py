"""MiniMax-M2's XML tool calls (vLLM's `minimax_m2`): a block of one or more `<invoke>`s, each
parameter's value as plain text:

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    </minimax:tool_call>

Names and keys may be quoted with " or ' or not at all. A value is stripped of the whitespace around
it and typed by the request's tool schema as vLLM's parser does: "null", "none" or "nil" is null; the
schema's types (its `type`, a list of them, the types of its `enum` values, and those of its anyOf,
oneOf and allOf branches) are tried integer, number, boolean, object, array, then string, the first
that converts winning; a parameter the schema does not name is a string; a value none of its types
takes is read as JSON, else kept as a string. JSON's non-finite numbers (NaN, 1e999) are no JSON a
client can read: such a value stays a string.

A call is announced once `<invoke name=...>` has ended, and its arguments grow one whole parameter at
a time (json.dumps' text). A call needs its `</invoke>`: one the text ends inside is no call (its text
is content), as in vLLM's one-shot parse; a stream keeps what it sent of it. The block's end tag may be
missing at the very end of the text, after a whole call.
"""

from __future__ import annotations

import json
from typing import Any

from xlaserve.entrypoints.serving.tool_parsers.base import Call, Parsed, is_start_of, parse_tagged
from xlaserve.entrypoints.serving.tool_parsers.json_scan import client_json, skip_ws
from xlaserve.entrypoints.serving.tool_parsers.qwen3_coder import (
    SchemaTypedToolParser,
    json_object_text,
    parameter_types,
)

_NULLS = ("null", "none", "nil")
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
# The order vLLM tries a value's types in: the most specific first, string last.
_TYPE_ORDER = (
    "integer",
    "int",
    "number",
    "float",
    "boolean",
    "bool",
    "object",
    "array",
    "string",
    "str",
    "text",
)
_ENUM_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"))
_MAX_SCHEMA_DEPTH = 16  # anyOf/oneOf/allOf nesting read for types (a request's schema may nest without end)


def schema_types(schema: Any, depth: int = 0) -> set[str]:
    """The JSON types a parameter's schema allows, lower-cased ({"string"} when it names none)."""
    if not isinstance(schema, dict) or depth > _MAX_SCHEMA_DEPTH:
        return {"string"}
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else []
    types = {kind for kind in kinds if isinstance(kind, str)}
    for value in schema.get("enum") if isinstance(schema.get("enum"), list) else ():
        if value is None:
            types.add("null")
        else:
            types.add(next((name for kind, name in _ENUM_TYPES if isinstance(value, kind)), "object"))
    for choice in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(choice) if isinstance(schema.get(choice), list) else ():
            types |= schema_types(branch, depth + 1)
    return {t.lower() for t in types} or {"string"}


def convert_value(value: str, schema: Any) -> Any:
    """A parameter's stripped text as the JSON value its schema's types give (module doc)."""
    if value.lower() in _NULLS:
        return None
    types = schema_types(schema)
    for kind in (k for k in _TYPE_ORDER if k in types):
        if kind in ("string", "str", "text"):
            return value
        if kind in ("integer", "int"):
            try:
                return int(value)
            except ValueError:
                continue
        elif kind in ("number", "float"):
            try:
                number = float(value)
                return int(number) if number == int(number) else number
            except (ValueError, OverflowError):  # not a number, nan, inf
                continue
        elif kind in ("boolean", "bool"):
            if value.lower() in _TRUE + _FALSE:
                return value.lower() in _TRUE
        else:
            is_json, converted = client_json(value)
            if is_json:
                return converted
    is_json, converted = client_json(value)
    return converted if is_json else value


def _unquote(name: str) -> str:
    name = name.strip()
    if len(name) >= 2 and name[0] == name[-1] and name[0] in "\"'":
        return name[1:-1]
    return name


class MiniMaxM2ToolParser(SchemaTypedToolParser):
    name = "minimax_m2"
    start_tag = "<minimax:tool_call>"
    end_tag = "</minimax:tool_call>"
    invoke_tag = "<invoke name="
    invoke_end = "</invoke>"
    parameter_tag = "<parameter name="
    parameter_end = "</parameter>"

    def _parse(self, text: str, final: bool, keep_broken: bool) -> Parsed:
        return parse_tagged(text, self.start_tag, final, keep_broken, self._read_block)

    def _read_block(
        self, text: str, pos: int, final: bool, keep_broken: bool, pieces: list
    ) -> tuple[int, bool]:
        """The invokes of the block at text[pos:] into `pieces`: (where content goes on, or -1 when the
        start tag was text; whether the rest is held back)."""
        found = 0
        while True:
            pos = skip_ws(text, pos)
            if text.startswith(self.invoke_tag, pos):
                call, end = self._read_invoke(text, pos, final, keep_broken)
                if call is None:
                    if end < 0:  # its name is still being written
                        return len(text), True
                    return (pos if found else -1), False
                pieces.append(call)
                found += 1
                if not call.is_complete:  # still being written, or broken after it went out
                    return end, False
                pos = end
            elif text.startswith(self.end_tag, pos) and found:
                return pos + len(self.end_tag), False
            elif not final and is_start_of(text, pos, (self.invoke_tag, self.end_tag)):
                return len(text), True
            else:  # the end tag missing at the very end, or text that is not the format's
                return (pos if found else -1), False

    def _read_invoke(self, text: str, pos: int, final: bool, keep_broken: bool) -> tuple[Call | None, int]:
        """The call at text[pos:] == '<invoke name=...': (the call, where it ends), or (None, -1) while
        its name is undecided, (None, 0) when it is no call. A call the text breaks or ends inside is
        kept, open, with keep_broken (where it broke: the content goes on there), else it is none."""
        name_start = pos + len(self.invoke_tag)
        name_end = text.find(">", name_start)
        raw_name = text[name_start : len(text) if name_end < 0 else name_end]
        if "\n" in raw_name or "<" in raw_name:
            return None, 0
        if name_end < 0:
            return (None, 0) if final else (None, -1)
        name = _unquote(raw_name)
        if not name:
            return None, 0
        schema = parameter_types(self._request, name)
        members: list[str] = []
        pos = name_end + 1
        while True:
            pos = skip_ws(text, pos)
            if text.startswith(self.invoke_end, pos):
                return Call(name, json_object_text(members, True), True), pos + len(self.invoke_end)
            is_open = not final and is_start_of(text, pos, (self.invoke_end, self.parameter_tag))
            if text.startswith(self.parameter_tag, pos):
                key_end = text.find(">", pos + len(self.parameter_tag))
                value_end = -1 if key_end < 0 else text.find(self.parameter_end, key_end + 1)
                invoke_end = text.find(self.invoke_end, pos)
                if value_end >= 0 and (invoke_end < 0 or value_end < invoke_end):
                    key = _unquote(text[pos + len(self.parameter_tag) : key_end])
                    value = convert_value(text[key_end + 1 : value_end].strip(), schema.get(key))
                    member = json.dumps({key: value}, ensure_ascii=False)[1:-1]
                    members.append(member)
                    pos = value_end + len(self.parameter_end)
                    continue
                is_open = not final and invoke_end < 0  # a value ends at its own </parameter> only
            if is_open:
                return Call(name, json_object_text(members, False), False), len(text)
            if keep_broken:
                return Call(name, json_object_text(members, False), False), pos
            return None, 0
