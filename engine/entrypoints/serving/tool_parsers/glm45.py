"""GLM-4.5's, 4.6's and 4.7's tool calls (vLLM's `glm45`): the function's name, then key/value pairs as
text, one `<tool_call>` per call:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

The name runs to the first newline or tag (GLM-4.7 writes `<arg_key>` straight after it; a call without
arguments may end right after it). A value is text, typed as vLLM types it: a parameter whose schema
says "string" keeps its text exactly; any other (or one no tool's schema knows) is its stripped text
read as JSON, then as a Python literal, else kept as a string. A call ends at the first
`</tool_call>`; one cut off at the end of the output (the model stopped) ends there, its last value as
far as it got. A key without a value is skipped, as vLLM's pattern skips it.

A call is announced once its name has ended; its arguments are `{"key": value, ...}` in json.dumps'
text, growing one whole pair at a time, except a string-typed value, which streams as it is written.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from xlaserve.entrypoints.serving.tool_parsers.base import Call, Parsed, held_suffix, parse_tagged
from xlaserve.entrypoints.serving.tool_parsers.json_scan import client_json, skip_ws
from xlaserve.entrypoints.serving.tool_parsers.qwen3_coder import (
    SchemaTypedToolParser,
    json_object_text,
    parameter_types,
)

_KEY, _KEY_END = "<arg_key>", "</arg_key>"
_VALUE, _VALUE_END = "<arg_value>", "</arg_value>"
_NOT_IN_NAME = frozenset(" \t\r<>{}[]()\"',=")  # not a function name: some other format's text


def _is_string(schema: Any) -> bool:
    return isinstance(schema, dict) and schema.get("type") == "string"


def convert_value(value: str, schema: Any) -> Any:
    """A value's text as vLLM's glm45 reads it (module doc); a literal with no JSON form (a set, a
    non-finite number) stays text."""
    if _is_string(schema):
        return value
    value = value.strip()
    is_json, converted = client_json(value)
    if is_json:
        return converted
    try:
        converted = ast.literal_eval(value)
        json.dumps(converted, allow_nan=False)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return value  # not a literal, or one with no JSON form (NaN, 1e999, a set)
    return converted


class Glm45ToolParser(SchemaTypedToolParser):
    name = "glm45"
    keeps_special_tokens = True  # vLLM's glm45 turns skip_special_tokens off for its tags
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def _parse(self, text: str, final: bool, keep_broken: bool) -> Parsed:
        return parse_tagged(text, self.start_tag, final, keep_broken, self._read_block)

    def _read_block(
        self, text: str, body: int, final: bool, keep_broken: bool, pieces: list
    ) -> tuple[int, bool]:
        """The call after a `<tool_call>` (text[body:]) into `pieces`: `parse_tagged`'s reader."""
        end = text.find(self.end_tag, body)
        if end >= 0 or final:
            region = text[body : len(text) if end < 0 else end]
        else:  # open: a possible end tag is held back
            region = text[body : len(text) - held_suffix(text, self.end_tag)]
        call, is_decided = self._read_call(region, is_closed=end >= 0 or final)
        if not is_decided:
            return 0, True
        if call is None:  # not a call: the tag is text
            return -1, False
        pieces.append(call)
        return (len(text) if end < 0 else end + len(self.end_tag)), False

    def _read_call(self, region: str, is_closed: bool) -> tuple[Call | None, bool]:
        """The call whose text (after `<tool_call>`, before its end) is `region`: (the call, True), (None,
        True) when it is no call, (None, False) while its name is still being written."""
        name_start = skip_ws(region, 0)
        ends = [i for i in (region.find("\n", name_start), region.find("<", name_start)) if i >= 0]
        name_end = min(ends, default=len(region))
        name = region[name_start:name_end].rstrip()
        if _NOT_IN_NAME.intersection(name):
            return None, True
        if name_end == len(region) and not is_closed:
            return None, False
        if not name:
            return None, True
        schema = parameter_types(self._request, name)
        members: list[str] = []
        pos = name_end
        while (key_start := region.find(_KEY, pos)) >= 0:
            key_end = region.find(_KEY_END, key_start)
            if key_end < 0:  # a key cut off: no pair (vLLM's pattern reads none either)
                break
            key = region[key_start + len(_KEY) : key_end].strip()
            value_start = skip_ws(region, key_end + len(_KEY_END))
            if not region.startswith(_VALUE, value_start):
                if not is_closed and _VALUE.startswith(region[value_start:]):
                    break  # the value may be about to start
                pos = value_start  # a key without a value: skipped
                continue
            value_start += len(_VALUE)
            value_end = region.find(_VALUE_END, value_start)
            if value_end < 0 and not is_closed:
                arguments = json_object_text(members, False)
                partial = _partial_string(region[value_start:], schema.get(key))
                if partial is not None:
                    arguments += f"{', ' if members else ''}{json.dumps(key, ensure_ascii=False)}: {partial}"
                return Call(name, arguments, False), True
            value = region[value_start : len(region) if value_end < 0 else value_end]
            member = convert_value(value, schema.get(key))
            members.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(member, ensure_ascii=False)}")
            pos = len(region) if value_end < 0 else value_end + len(_VALUE_END)
        return Call(name, json_object_text(members, is_closed), is_closed), True


def _partial_string(value: str, schema: Any) -> str | None:
    """The JSON text so far of a string-typed value still being written, a possible end tag held back;
    None for any other type (its value is read whole)."""
    if not _is_string(schema):
        return None
    value = value[: len(value) - held_suffix(value, _VALUE_END)]
    return json.dumps(value, ensure_ascii=False)[:-1]
