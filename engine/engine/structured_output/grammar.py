"""A structured-output spec (`StructuredOutputsParams`) as llguidance grammar text, and its check.

The text is deterministic for a spec, so it is also the key under which the engine core caches the
compiled grammar. `check_grammar` runs in the front end, before a request is queued: it compiles the
grammar without a tokenizer (no token trie, so it is cheap) and turns what llguidance rejects (a
regex that does not parse, a schema keyword it does not implement) into a ValueError naming the
member, so that a bad spec is a 400, never an unconstrained answer.
"""

from __future__ import annotations

import copy
import functools
import json

import llguidance

from xlaserve.structured_outputs_params import StructuredOutputsError, StructuredOutputsParams

_MAX_CACHED_CHECKS = 64  # specs are up to 256 KiB of text each
# The whitespace JSON may hold between tokens unless the request says otherwise: up to two spaces or
# tabs, then at most one line break and its indentation. llguidance's own default (and vLLM's) is
# any run of whitespace, where small models often loop on newlines until max_tokens, so that the
# JSON never closes; bounded, every gap ends. `whitespace_pattern` restores any pattern.
DEFAULT_WHITESPACE_PATTERN = r"[\x20\x09]{0,2}(\x0D?\x0A[\x20\x09]{0,32})?"


def grammar_source(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for `params`; StructuredOutputsError when it cannot even be written."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else params.json
        if isinstance(schema, str):
            schema = json.loads(schema)  # SamplingParams proved it parses
        if params.disable_additional_properties:
            schema = _without_additional_properties(copy.deepcopy(schema))
        if params.whitespace_pattern is not None:
            options = {"whitespace_pattern": params.whitespace_pattern}
        elif params.disable_any_whitespace:
            options = {"whitespace_flexible": False}
        else:
            options = {"whitespace_pattern": DEFAULT_WHITESPACE_PATTERN}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as e:
            raise StructuredOutputsError(kind, f"is not a valid JSON schema: {e}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", params.choice)
    if kind == "grammar":
        try:  # GBNF is converted to Lark; Lark passes through
            return llguidance.grammar_from("grammar", params.grammar)
        except ValueError as e:
            raise StructuredOutputsError("grammar", f"is not a valid grammar: {e}") from None
    return _structural_tag_source(params.structural_tag)


def _structural_tag_source(text: str) -> str:
    """vLLM's structural tag, {"structures": [{"begin", "schema", "end"}], "triggers": [...]}: free
    text in which each structure starts at a trigger and holds JSON of its schema."""
    spec = json.loads(text)
    triggers, structures = spec.get("triggers"), spec.get("structures")
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise StructuredOutputsError("structural_tag", "needs 'triggers', a list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise StructuredOutputsError("structural_tag", "needs 'structures', a non-empty list")
    tags = []
    for i, structure in enumerate(structures):
        if not isinstance(structure, dict) or not {"begin", "schema", "end"} <= set(structure):
            raise StructuredOutputsError(
                "structural_tag", f"structures[{i}] must be an object with 'begin', 'schema' and 'end'"
            )
        begin, schema, end = structure["begin"], structure["schema"], structure["end"]
        if not isinstance(begin, str) or not isinstance(end, str) or not isinstance(schema, dict):
            raise StructuredOutputsError(
                "structural_tag", f"structures[{i}]: 'begin' and 'end' must be strings, 'schema' an object"
            )
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise StructuredOutputsError(
                "structural_tag", f"structures[{i}].begin {begin!r} starts with none of the triggers"
            )
        tags.append(llguidance.StructTag(trigger=trigger, begin=begin, grammar=schema, end=end))
    return llguidance.StructTag.to_grammar(tags)


def _without_additional_properties(schema):
    """Every object schema that does not say otherwise takes only the properties it names."""
    if isinstance(schema, dict):
        if (
            schema.get("type") == "object" or "properties" in schema
        ) and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        for value in schema.values():
            _without_additional_properties(value)
    elif isinstance(schema, list):
        for value in schema:
            _without_additional_properties(value)
    return schema


def check_grammar(params: StructuredOutputsParams) -> str:
    """The grammar source of `params`, once llguidance accepts it; else StructuredOutputsError naming
    the member and llguidance's reason."""
    source = grammar_source(params)
    error = _grammar_error(source)
    if error:
        raise StructuredOutputsError(params.kind, f"is not supported or not valid: {error}")
    return source


@functools.lru_cache(maxsize=_MAX_CACHED_CHECKS)
def _grammar_error(source: str) -> str | None:
    # Clients resend the same schema request after request: each is compiled once.
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, None)
    return messages[0] if is_error else None
