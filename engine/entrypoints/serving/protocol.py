"""The strict pydantic types every HTTP request is made of, the sampling fields the generating routes
share (`SamplingFields`: completions, chat, and what the Responses API maps onto them), and the error
shape. The chat request built on them is serving/chat_protocol.py's.

Request models forbid unknown fields: a misspelt or unsupported field is a 400 naming it, never a
silently ignored option. Fields OpenAI defines that we do not implement yet are listed in
`UNSUPPORTED_FIELDS` and rejected with a message saying so.

Types are strict, as in OpenAI's API: `"16"`, `true` and `16.0` are not integers and `"yes"` is not a
boolean; only number fields accept integers. Every string is `Text`: one that cannot be encoded as
UTF-8 (a lone surrogate, escaped in JSON or decoded from invalid bytes) is a 400 naming its field,
before it can reach the tokenizer.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    create_model,
    model_serializer,
)
from pydantic_core import PydanticCustomError

# OpenAI fields we do not implement yet: a request that sets one gets a 400 naming it.
UNSUPPORTED_FIELDS = frozenset(
    {
        "functions",
        "function_call",
        "suffix",
        "best_of",
        "audio",
        "modalities",
        "prediction",
        "web_search_options",
        "guided_json",
        "guided_regex",
    }
)

MAX_N = 64  # choices per request: each is a sequence in the batch
_INT64 = 2**63


def _check_unicode(text: str) -> str:
    """Lone surrogates pass `str` validation but break the tokenizer and the JSON encoder."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError(
            "string_unicode", "invalid Unicode at character {position}", {"position": e.start}
        ) from None
    return text


def _check_json_unicode(value):
    """A JSON value (a schema) whose strings hold no lone surrogate: they would reach llguidance."""
    _check_unicode(json.dumps(value, ensure_ascii=False))
    return value


Text = Annotated[str, AfterValidator(_check_unicode)]
JsonObject = Annotated[dict[str, Any], AfterValidator(_check_json_unicode)]
# OpenAI's metadata: up to 16 string values of up to 512 characters each.
Metadata = Annotated[dict[str, Annotated[Text, Field(max_length=512)]], Field(max_length=16)]
ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]
# A request's own chat template (vLLM's `chat_template` field; the server must trust such templates:
# --trust-request-chat-template). Bounded like a prompt's text, not by the template's work.
MAX_CHAT_TEMPLATE_CHARS = 65536
ChatTemplate = Annotated[
    str, Field(min_length=1, max_length=MAX_CHAT_TEMPLATE_CHARS), AfterValidator(_check_unicode)
]
CHAT_TEMPLATE_HELP = "a Jinja chat template for this request (the server needs --trust-request-chat-template)"
PositiveTokens = Annotated[int, Field(ge=1, le=2**31 - 1)]


def _check_keep(keep: int) -> int:
    if keep == 0:
        raise PydanticCustomError("keep_tokens", "must be >= 1, or -1 (the context's length), got 0")
    return keep


# vLLM's truncate_prompt_tokens: keep the prompt's last N tokens (-1: as many as the context holds).
TruncatePromptTokens = Annotated[int, Field(ge=-1, le=2**31 - 1), AfterValidator(_check_keep)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
Seed = Annotated[int, Field(ge=-_INT64, le=_INT64 - 1)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
PromptList = Annotated[list[Text], Field(max_length=64)]
StopString = Annotated[Text, Field(max_length=1024)]  # matched against the text's tail every step


class OmitsNones(BaseModel):
    """A wire shape that leaves out its `omit_if_none` fields whose value is None (OpenAI and Anthropic
    leave absent fields out; the others are sent as null)."""

    omit_if_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _drop_nones(self, handler):
        data = handler(self)
        return {k: v for k, v in data.items() if v is not None or k not in self.omit_if_none}


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def type_union(members: dict[str, type[BaseModel]], suffix: str, *, default: str | None = None) -> Any:
    """The union of `{"type": ...}` models, each tagged `{type}-{suffix}` (`text-block`); `default` is the
    type of a value without one. A missing or unknown type is checked against a model of that one
    field, tagged `unknown-{suffix}`, so the error names `type` and lists the known ones rather than
    every member's errors. The tags are not fields: the API's tag set lists them for error locations."""
    unknown = create_model(
        f"_Unknown{suffix.capitalize()}", __base__=StrictModel, type=(Literal[tuple(members)], ...)
    )

    def tag(value) -> str:
        kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", None)
        return f"{kind}-{suffix}" if isinstance(kind, str) and kind in members else f"unknown-{suffix}"

    tagged = [Annotated[model, Tag(f"{kind}-{suffix}")] for kind, model in members.items()]
    return Annotated[Union[(*tagged, Annotated[unknown, Tag(f"unknown-{suffix}")])], Discriminator(tag)]


def mode_or_function(function_choice: type[BaseModel], prefix: str, message: str):
    """A tool_choice: a mode string ('none', 'auto', 'required') or an object naming a function
    (`function_choice`), told apart up front so only that branch's errors are reported (`message` when
    it is neither); tagged `{prefix}-mode` / `{prefix}-function`, which the API's tag set lists."""

    def kind(value) -> str | None:
        if isinstance(value, str):
            return f"{prefix}-mode"
        return f"{prefix}-function" if isinstance(value, dict) else None

    return Annotated[
        Annotated[Literal["none", "auto", "required"], Tag(f"{prefix}-mode")]
        | Annotated[function_choice, Tag(f"{prefix}-function")],
        Discriminator(kind, custom_error_type="tool_choice_type", custom_error_message=message),
    ]


def text_or_list(kind, max_length: int | None = None):
    """A string, or a list of `kind`'s parts, told apart up front so an error names the element
    (`messages[0].content[1].uuid`) rather than both branches."""

    def tag(value) -> str | None:
        if isinstance(value, str):
            return "text-value"
        return "list-value" if isinstance(value, list) else None

    return Annotated[
        Annotated[Text, Tag("text-value")]
        | Annotated[list[kind], Field(max_length=max_length), Tag("list-value")],
        Discriminator(
            tag, custom_error_type="content_type", custom_error_message="must be a string or a list of parts"
        ),
    ]


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(StrictModel):
    name: Text = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: Text | None = None
    schema_: JsonObject | None = Field(default=None, alias="schema", description="none: any JSON object")
    strict: bool | None = Field(default=None, description="accepted; the schema is always enforced")


class ResponseFormat(StrictModel):
    """OpenAI's `response_format`: text (unconstrained), any JSON object, or JSON of a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsFields(StrictModel):
    """vLLM's `structured_outputs` (xlaserve.sampling_params.StructuredOutputsParams): set one of
    json, regex, choice, grammar, json_object, structural_tag."""

    json_: JsonObject | Text | None = Field(default=None, alias="json", description="a JSON schema")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = Field(default=None, description="llguidance's Lark-like syntax, or GBNF")
    json_object: bool | None = None
    structural_tag: Text | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Text | None = None


class KVTransferParams(StrictModel):
    """vLLM's `kv_transfer_params` (disaggregated prefill; README "Disaggregated prefill"): a router
    asks a producer to prefill only (`do_remote_decode`), then sends the producer's answer's params to
    a consumer (`do_remote_prefill`, naming where the prompt's blocks are)."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_host: Text | None = Field(default=None, min_length=1, max_length=255)
    remote_port: int | None = Field(default=None, ge=1, le=65535)
    remote_request_id: Text | None = Field(default=None, min_length=1, max_length=256)


class SamplingFields(StrictModel):
    """Fields common to /v1/completions and /v1/chat/completions (OpenAI's, then vLLM's extras)."""

    model: Text | None = Field(default=None, description="the served model name (optional)")
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, description="default 1.0")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: StopString | Annotated[list[StopString], Field(max_length=16)] | None = None
    seed: Seed | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = Field(default=None, max_length=256, description="accepted and ignored")
    # vLLM's extras
    request_id: Text | None = Field(
        default=None,
        description="the answer's id after the route's prefix (an X-Request-Id header wins, as in vLLM); "
        "1 to 128 printable ASCII characters",
    )
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    min_tokens: int = Field(default=0, ge=0, le=2**31 - 1)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=64)
    logit_bias: (
        Annotated[
            dict[Annotated[str, Field(max_length=16)], float],
            Field(max_length=1024),
        ]
        | None
    ) = Field(
        default=None,
        description="OpenAI's: token id (as a string) -> a bias on its logit, clamped to [-100, 100] (vLLM)",
    )
    bad_words: (
        Annotated[list[Annotated[Text, Field(min_length=1, max_length=256)]], Field(max_length=128)] | None
    ) = Field(default=None, description="words never generated (vLLM's)")
    allowed_token_ids: list[TokenId] | None = Field(
        default=None, min_length=1, max_length=2**17, description="only these tokens may be sampled"
    )
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = Field(
        default=True, description="False: an added token directly after another is joined to it (vLLM's)"
    )
    prompt_logprobs: int | None = Field(
        default=None,
        ge=-1,
        description="the prompt tokens' logprobs, with this many alternatives (-1: the whole vocabulary)",
    )
    return_tokens_as_token_ids: bool = Field(
        default=False, description='logprobs name tokens "token_id:{id}"'
    )
    return_token_ids: bool = Field(default=False, description="the prompt's and each choice's token ids too")
    truncate_prompt_tokens: TruncatePromptTokens | None = Field(
        default=None, description="keep the prompt's last N tokens (-1: the context's length)"
    )
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)
    cache_salt: Text | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="isolates prefix-cache sharing: requests only share cached blocks with equal salts",
    )
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    kv_transfer_params: KVTransferParams | None = None
    use_beam_search: bool = Field(
        default=False, description="n beams (at most 10) instead of n samples (serving/beam_search.py)"
    )
    length_penalty: float = Field(
        default=1.0, ge=-10.0, le=10.0, description="beam search: scores are cum_logprob / length ** this"
    )


# -- the error shape (OpenAI's; errors.py also writes Anthropic's) ----------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


# A 200 that streams server-sent events when the request says `"stream": true`: OpenAPI before 3.2 has a
# text/event-stream `schema` describe each event (its fields; `data` the JSON chunk as text), which is how
# schema checkers such as schemathesis read every event of the stream against it.
SSE_EVENT_SCHEMA = {
    "type": "object",
    "properties": {
        "event": {"type": "string"},
        "data": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}


def sse_or_json(model) -> dict:
    """The `responses` entry of a route answering JSON (`model`), or server-sent events."""
    return {200: {"model": model, "content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}}}}


class ErrorResponse(BaseModel):
    error: ErrorInfo
