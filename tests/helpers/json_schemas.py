"""Twenty JSON schemas for the structured-output tests: nested objects, arrays, enums, optional fields,
bounded numbers and string patterns. Strings, arrays and numbers are bounded so that even a 135M
model sampling at temperature 1 completes each well within a modest max_tokens."""

from __future__ import annotations


def _str(max_length: int, **extra) -> dict:
    return {"type": "string", "maxLength": max_length, **extra}


def _int(minimum: int, maximum: int) -> dict:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


def _array(items: dict, min_items: int, max_items: int) -> dict:
    return {"type": "array", "items": items, "minItems": min_items, "maxItems": max_items}


def _object(properties: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


_DATE = "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])$"
SCHEMAS: dict[str, dict] = {
    "person": _object({"name": _str(12), "age": _int(0, 120)}),
    "address": _object(
        {
            "user": _object(
                {
                    "name": _str(10),
                    "address": _object({"city": _str(12), "zip": _str(5, pattern="^[0-9]{5}$")}),
                }
            )
        }
    ),
    "digits": _array(_int(0, 9), 1, 4),
    "color": _object({"color": {"enum": ["red", "green", "blue"]}}),
    "optional": _object(
        {"title": _str(10), "subtitle": _str(10), "year": _int(1900, 2099)}, required=["title"]
    ),
    "score": _object({"score": {"type": "number", "minimum": 0, "maximum": 1}}),
    "code": _object({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    "flags": _object({"ok": {"type": "boolean"}, "count": _int(1, 5)}),
    "items": _array(_object({"id": _int(1, 99), "tag": {"enum": ["a", "b"]}}), 1, 3),
    "const": _object({"version": {"const": "1.0"}, "name": _str(8)}),
    "any_of": _object({"value": {"anyOf": [_int(0, 100), _str(6)]}}),
    "nullable": _object({"middle": {"type": ["string", "null"], "maxLength": 6}, "last": _str(10)}),
    "refs": {
        "$defs": {"point": _object({"x": _int(-9, 9), "y": _int(-9, 9)})},
        **_object({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}),
    },
    "exclusive": _object({"temp": {"type": "number", "exclusiveMinimum": -10, "exclusiveMaximum": 40}}),
    "date": _object({"date": {"type": "string", "pattern": _DATE}}),
    "stars": _object({"stars": {"enum": [1, 2, 3, 4, 5]}, "review": _str(12)}),
    "matrix": _object({"matrix": _array(_array(_int(0, 9), 2, 2), 2, 2)}),
    "greek": {"enum": ["alpha", "beta", "gamma"]},
    "deep": _object({"a": _object({"b": _object({"c": _int(0, 99)})})}),
    "pin": _object({"pin": _str(4, pattern="^[0-9]+$", minLength=4), "valid": {"type": "boolean"}}),
}
