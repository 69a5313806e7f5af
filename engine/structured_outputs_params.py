"""Constrained decoding's request parameters (vLLM's `StructuredOutputsParams`, same names), validated
when built; `xlaserve.sampling_params` re-exports them, where vLLM users import them from."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any


def is_int(value) -> bool:
    """An int that is not a bool (True as a token id or count is always a caller bug)."""
    return isinstance(value, int) and not isinstance(value, bool)


class StructuredOutputsError(ValueError):
    """A bad structured-output spec; `param` names the member ("structured_outputs.regex"), `reason`
    says what is wrong with it."""

    def __init__(self, member: str | None, reason: str):
        self.member = member
        self.reason = reason
        self.param = "structured_outputs" if member is None else f"structured_outputs.{member}"
        super().__init__(f"{self.param} {reason}")


# The members that each constrain the output; exactly one is set.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# Bounds on what a request may ask the grammar compiler to do (it runs in the engine core).
MAX_SPEC_CHARS = 256 * 1024
MAX_CHOICES = 1024
MAX_SCHEMA_DEPTH = 64  # nesting of a JSON schema's objects and arrays (each level is recursion somewhere)
# Tokens allowed between a reasoning end's prefix ids and its end token (gpt-oss: `<|constrain|>json`).
REASONING_END_MAX_GAP = 16


@dataclass(frozen=True, repr=False)
class StructuredOutputsParams:
    """Constrain the output to a language, as vLLM's `StructuredOutputsParams` (same names).

    Exactly one of: `json` (a JSON schema, as a dict or its JSON text), `regex`, `choice` (one of these
    strings, verbatim), `grammar` (llguidance's Lark-like syntax, or GBNF), `json_object=True` (any JSON
    object), `structural_tag` (vLLM's JSON: {"structures": [{"begin", "schema", "end"}], "triggers"}).
    Options for JSON: `disable_any_whitespace` (compact output, no free whitespace between tokens),
    `disable_additional_properties` (objects take only the properties they name), `whitespace_pattern`
    (a regex for the whitespace that may separate JSON tokens).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    # The grammar starts applying after this token (a reasoning model's end of thinking, e.g. the id of
    # "</think>"); None: from the first token. The server sets it from its --reasoning-parser.
    reasoning_end_token_id: int | None = None
    # Where one token does not end the thinking (gpt-oss's harmony format: the answer is the body of the
    # final channel's message), these ids first (`<|channel|>final`), then within
    # REASONING_END_MAX_GAP tokens of them reasoning_end_token_id (`<|message|>`, after an optional
    # `<|constrain|>json`): the grammar starts after that token.
    reasoning_end_prefix_ids: list[int] | None = None

    def __post_init__(self):
        if self.reasoning_end_token_id is not None and not (
            is_int(self.reasoning_end_token_id) and self.reasoning_end_token_id >= 0
        ):
            raise StructuredOutputsError(
                "reasoning_end_token_id",
                f"must be a token id (an integer >= 0), got {self.reasoning_end_token_id!r}",
            )
        prefix = self.reasoning_end_prefix_ids
        if prefix is not None:
            if not isinstance(prefix, list) or not prefix or not all(is_int(i) and i >= 0 for i in prefix):
                raise StructuredOutputsError(
                    "reasoning_end_prefix_ids", f"must be a non-empty list of token ids, got {_short(prefix)}"
                )
            if len(prefix) > REASONING_END_MAX_GAP or self.reasoning_end_token_id is None:
                raise StructuredOutputsError(
                    "reasoning_end_prefix_ids",
                    f"must hold at most {REASONING_END_MAX_GAP} ids, beside a reasoning_end_token_id",
                )
        kinds = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise StructuredOutputsError(
                None,
                f"must set exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}; "
                f"got {', '.join(kinds) or 'none'}",
            )
        for name in ("regex", "grammar", "structural_tag", "whitespace_pattern"):
            self._check_text(name)
        if self.json is not None:
            self._check_json()
        if self.choice is not None:
            self._check_choice()
        if self.json_object is not None and self.json_object is not True:
            raise StructuredOutputsError("json_object", f"must be true when set, got {self.json_object!r}")
        if self.structural_tag is not None:
            _parse_json_text(self.structural_tag, "structural_tag", dict)
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise StructuredOutputsError(name, f"must be a boolean, got {getattr(self, name)!r}")

    def _check_text(self, name: str) -> None:
        value = getattr(self, name)
        if value is None:
            return
        if not isinstance(value, str) or not value:
            raise StructuredOutputsError(name, f"must be a non-empty string, got {_short(value)}")
        if len(value) > MAX_SPEC_CHARS:
            raise StructuredOutputsError(name, f"has {len(value)} characters; the limit is {MAX_SPEC_CHARS}")

    def _check_json(self) -> None:
        if isinstance(self.json, str):
            self._check_text("json")
            schema = _parse_json_text(self.json, "json", (dict, bool))
        elif isinstance(self.json, dict):
            schema = self.json
        else:
            raise StructuredOutputsError(
                "json", f"must be a JSON schema (an object or its text), got {_short(self.json)}"
            )
        if _depth(schema) > MAX_SCHEMA_DEPTH:
            raise StructuredOutputsError("json", f"is nested more than {MAX_SCHEMA_DEPTH} levels deep")
        if isinstance(self.json, dict) and len(json.dumps(self.json)) > MAX_SPEC_CHARS:
            raise StructuredOutputsError("json", f"is longer than {MAX_SPEC_CHARS} characters as JSON")

    def _check_choice(self) -> None:
        if not isinstance(self.choice, list) or not self.choice:
            raise StructuredOutputsError(
                "choice", f"must be a non-empty list of strings, got {_short(self.choice)}"
            )
        if len(self.choice) > MAX_CHOICES:
            raise StructuredOutputsError(
                "choice", f"has {len(self.choice)} entries; the limit is {MAX_CHOICES}"
            )
        for option in self.choice:
            if not isinstance(option, str) or not option:
                raise StructuredOutputsError(
                    "choice", f"entries must be non-empty strings, got {_short(option)}"
                )
        if sum(len(option) for option in self.choice) > MAX_SPEC_CHARS:
            raise StructuredOutputsError("choice", f"holds more than {MAX_SPEC_CHARS} characters in all")

    @property
    def kind(self) -> str:
        """The member that constrains the output ("json", "regex", ...)."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) is not None)

    def __repr__(self) -> str:
        # A schema can be large: logs get its kind and size, not its text.
        spec = getattr(self, self.kind)
        size = len(spec if isinstance(spec, str) else json.dumps(spec))
        options = [
            f.name for f in fields(self) if f.name not in STRUCTURED_OUTPUT_KINDS and getattr(self, f.name)
        ]
        return f"StructuredOutputsParams({self.kind}, {size} chars{''.join(', ' + o for o in options)})"


def _parse_json_text(text: str, member: str, kinds) -> Any:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise StructuredOutputsError(member, f"is not valid JSON: {e}") from None
    if not isinstance(value, kinds):
        raise StructuredOutputsError(member, f"must be a JSON object, got {type(value).__name__}")
    return value


def _depth(value) -> int:
    """How deeply objects and arrays nest in a JSON value (without recursion: it may be very deep)."""
    depth, level = 0, [value]
    while level:
        level = [
            v
            for c in level
            if isinstance(c, (dict, list))
            for v in (c.values() if isinstance(c, dict) else c)
        ]
        depth += 1
    return depth - 1


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
