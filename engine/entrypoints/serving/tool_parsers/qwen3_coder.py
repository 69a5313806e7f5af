"""Qwen3-Coder's XML tool calls (vLLM's `qwen3_coder`), one `<function=...>` per call, each parameter's
value as plain text:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A value is text, so its JSON type comes from the request's tool schema, as vLLM converts it: "null" is
null; a parameter the schema does not type stays a string; integer, number and boolean types are
converted, and any other type (object, array, a list of types) is read as JSON, then as a Python
literal, else kept as a string. A value ends at `</parameter>`, or where the next parameter, the
function's end or the call's end begins; one newline on each side of it is the format's, not the
value's. The `<tool_call>` wrapper may be missing (vLLM reads a bare `<function=...>` too), and so may
`</function>` at the very end (the model stopped).

A call is announced once `<function=NAME>` has ended; its arguments are `{"key": value, ...}` in
json.dumps' text, growing one whole parameter at a time (a value's type is only known when it has
ended), except a string-typed value, which streams as it is written.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from xlaserve.entrypoints.serving.tool_parsers.base import Call, Parsed, ToolParser, held_suffix
from xlaserve.entrypoints.serving.tool_parsers.json_scan import skip_ws

_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_INT_PREFIXES = ("int", "uint", "long", "short", "unsigned")
_JSON_TYPES = ("object", "array", "arr")
_PARAMETER_END = "</parameter>"


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


def parameter_types(request: Any, function_name: str) -> dict:
    """The request's JSON schema properties of `function_name`'s parameters ({}: none known)."""
    for tool in _get(request, "tools") or ():
        function = _get(tool, "function")
        if _get(tool, "type") != "function" or _get(function, "name") != function_name:
            continue
        parameters = _get(function, "parameters")
        if not isinstance(parameters, dict):
            return {}
        properties = parameters.get("properties", parameters)  # vLLM's reading: a bare map works too
        return properties if isinstance(properties, dict) else {}
    return {}


def _kind(schema: Any) -> str:
    return str(schema["type"]).strip().lower() if isinstance(schema, dict) and "type" in schema else "string"


def convert_value(value: str, schema: Any) -> Any:
    """A parameter's text as the JSON value its schema's type asks for (vLLM's conversion)."""
    if value.lower() == "null":
        return None
    kind = _kind(schema)
    if kind in _STRING_TYPES:
        return value
    if kind.startswith(_INT_PREFIXES):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
            return int(number) if number == int(number) else number
        except (ValueError, OverflowError):  # not a number, nan, inf
            return value
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    if kind in _JSON_TYPES or kind.startswith(("dict", "list")):
        try:
            return json.loads(value)
        except ValueError:
            pass
    try:
        converted = ast.literal_eval(value)
        json.dumps(converted)  # a set, bytes or complex literal has no JSON form
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return value
    return converted


class SchemaTypedToolParser(ToolParser):
    """A format whose values are text, typed by the request's tool schemas: it keeps the request."""

    def __init__(self, tokenizer: Any = None):
        super().__init__(tokenizer)
        self._request: Any = None  # the request whose tools' schemas type the values

    def extract_tool_calls(self, model_output: str, request: Any = None):
        self._request = request
        return super().extract_tool_calls(model_output, request)

    def extract_tool_calls_streaming(self, previous_text, current_text, delta_text, request=None):
        self._request = request
        return super().extract_tool_calls_streaming(previous_text, current_text, delta_text, request)

    def finish_streaming(self, current_text: str, request: Any = None):
        self._request = request
        return super().finish_streaming(current_text, request)


class Qwen3CoderToolParser(SchemaTypedToolParser):
    name = "qwen3_coder"
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"
    function_tag = "<function="
    function_end = "</function>"
    parameter_tag = "<parameter="
    parameter_end = _PARAMETER_END

    def _parse(self, text: str, final: bool, keep_broken: bool) -> Parsed:
        pieces: list = []
        pos = 0
        while True:
            start, tag = _first(text, pos, (self.start_tag, self.function_tag))
            if tag is None:
                held = 0
                if not final:
                    held = max(held_suffix(text, self.start_tag), held_suffix(text, self.function_tag))
                pieces.append(text[pos : len(text) - held])
                return Parsed(pieces, is_held=held > 0)
            pieces.append(text[pos:start])
            is_wrapped = tag == self.start_tag
            function = skip_ws(text, start + len(tag)) if is_wrapped else start
            if is_wrapped and not text.startswith(self.function_tag, function):
                if not final and self.function_tag.startswith(text[function:]):
                    return Parsed(pieces, is_held=True)
                pieces.append(tag)  # not this format's call: the tag is text
                pos = start + len(tag)
                continue
            is_first = True
            while True:  # the functions in this call (vLLM reads several in one <tool_call>)
                call, end = self._read_function(text, function, final, is_wrapped)
                if call is None:
                    if end < 0:  # its name is still being written
                        return Parsed(pieces, is_held=True)
                    if is_first:  # not a call: the tag is text
                        pieces.append(tag)
                    pos = start + len(tag) if is_first else function
                    break
                is_first = False
                pieces.append(call)
                if not call.is_complete:
                    return Parsed(pieces)
                pos = end
                if not is_wrapped:
                    break
                after = skip_ws(text, end)
                if text.startswith(self.function_tag, after):
                    function = after
                    continue
                if text.startswith(self.end_tag, after):
                    pos = after + len(self.end_tag)
                elif not final and self.end_tag.startswith(text[after:]):
                    return Parsed(pieces, is_held=True)  # maybe the end tag: it is part of the call
                break

    def _read_function(self, text: str, pos: int, final: bool, is_wrapped: bool) -> tuple[Call | None, int]:
        """The call at text[pos:] == "<function=...": (the call, where it ends), or (None, -1) while
        its name is undecided, (None, 0) when it is not a call."""
        name_start = pos + len(self.function_tag)
        name_end = text.find(">", name_start)
        name = text[name_start : len(text) if name_end < 0 else name_end]
        if "\n" in name or "<" in name or (name_end >= 0 and not name):
            return None, 0
        if name_end < 0:
            return (None, 0) if final else (None, -1)
        schema = parameter_types(self._request, name)
        ends = (
            (self.parameter_tag, self.function_end, self.end_tag)
            if is_wrapped
            else (self.parameter_tag, self.function_end)
        )
        members: list[str] = []
        pos = name_end + 1
        while True:
            at, tag = _first(text, pos, ends)
            if tag is None or tag != self.parameter_tag:
                if tag is None and not final:
                    return Call(name, json_object_text(members, False), False), len(text)
                end = len(text) if tag is None else at + len(tag) * (tag == self.function_end)
                return Call(name, json_object_text(members, True), True), end
            key_end = text.find(">", at + len(tag))
            if key_end < 0:  # a key never ended: vLLM could not read it either
                if not final:
                    return Call(name, json_object_text(members, False), False), len(text)
                return Call(name, json_object_text(members, True), True), len(text)
            key = text[at + len(tag) : key_end]
            value_end, value_tag = _first(text, key_end + 1, (self.parameter_end, *ends))
            if value_tag is None:
                if not final:
                    arguments = json_object_text(members, False)
                    if (partial := _partial_string(text[key_end + 1 :], schema.get(key), ends)) is not None:
                        arguments += (
                            f"{', ' if members else ''}{json.dumps(key, ensure_ascii=False)}: {partial}"
                        )
                    return Call(name, arguments, False), len(text)
                value_end = len(text)
            value = text[key_end + 1 : value_end]
            value = value.removeprefix("\n").removesuffix("\n")
            member = convert_value(value, schema.get(key))
            members.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(member, ensure_ascii=False)}")
            pos = value_end + len(self.parameter_end) if value_tag == self.parameter_end else value_end


def _partial_string(value: str, schema: Any, ends: tuple[str, ...]) -> str | None:
    """The JSON text so far of a string value still being written (long code or file contents stream
    as they come), or None while it may still be something else: not a string type, or maybe "null".
    Held back: a possible end tag, and a last newline (the format's, if the value ends there)."""
    if _kind(schema) not in _STRING_TYPES:
        return None
    value = value.removeprefix("\n")
    value = value[: len(value) - max(held_suffix(value, tag) for tag in (_PARAMETER_END, *ends))]
    value = value.removesuffix("\n")
    if "null".startswith(value.lower()):
        return None
    return json.dumps(value, ensure_ascii=False)[:-1]


def _first(text: str, pos: int, tags: tuple[str, ...]) -> tuple[int, str | None]:
    """The earliest of `tags` in text[pos:]: (where, which), or (len(text), None)."""
    found = [(i, tag) for tag in tags if (i := text.find(tag, pos)) >= 0]
    return min(found) if found else (len(text), None)


def json_object_text(members: list[str], is_closed: bool) -> str:
    """`{"key": value, ...}` from json.dumps'd members, closed or still open."""
    return "{" + ", ".join(members) + ("}" if is_closed else "")
