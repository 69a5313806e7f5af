"""A request's `response_format` (OpenAI's) or `structured_outputs` (vLLM's) as the engine's
`StructuredOutputsParams`, checked against llguidance before the request is queued: a bad schema,
regex or grammar is a 400 naming the field as the client sent it, never an unconstrained answer."""

from __future__ import annotations

from xlaserve.engine.structured_output import check_grammar
from xlaserve.entrypoints.serving.errors import bad_request
from xlaserve.entrypoints.serving.protocol import SamplingFields
from xlaserve.structured_outputs_params import StructuredOutputsError, StructuredOutputsParams

# Where a spec built from response_format came from, by the member it sets.
_RESPONSE_FORMAT_PARAMS = {"json": "response_format.json_schema.schema", "json_object": "response_format"}


def structured_outputs_of(req: SamplingFields) -> StructuredOutputsParams | None:
    """The constraint a request asks for (None: unconstrained); a 400 naming the field if it is bad."""
    response_format = req.response_format
    if response_format is not None and response_format.type == "text":
        response_format = None
    if response_format is not None and req.structured_outputs is not None:
        raise bad_request("set response_format or structured_outputs, not both", "structured_outputs")
    if req.structured_outputs is not None:
        fields = req.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        return _checked(lambda: StructuredOutputsParams(**fields), {})
    if response_format is None:
        return None
    if response_format.type == "json_object":
        return _checked(lambda: StructuredOutputsParams(json_object=True), _RESPONSE_FORMAT_PARAMS)
    if response_format.json_schema is None:
        raise bad_request(
            "response_format of type 'json_schema' needs 'json_schema': {'name', 'schema'}",
            "response_format.json_schema",
        )
    schema = response_format.json_schema.schema_
    spec = {"json": schema} if schema is not None else {"json_object": True}
    return _checked(lambda: StructuredOutputsParams(**spec), _RESPONSE_FORMAT_PARAMS)


def _checked(build, renamed: dict[str, str]) -> StructuredOutputsParams:
    """build() and compile-check the spec; errors become 400s, their param renamed per `renamed` (the
    member the spec sets -> the field the client sent)."""
    try:
        params = build()
        check_grammar(params)
        return params
    except StructuredOutputsError as e:
        param = renamed.get(e.member, e.param)
        raise bad_request(f"{param} {e.reason}", param) from None
