"""OpenAI's request and response shapes (pydantic), plus vLLM's extra sampling fields.

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
import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, model_serializer
from pydantic_core import PydanticCustomError

from xlaserve.entrypoints.openai.tool_protocol import DeltaToolCallOut, ToolCallOut, without_nones
from xlaserve.sampling_params import MAX_LOGPROBS

# OpenAI fields we do not implement yet: a request that sets one gets a 400 naming it.
UNSUPPORTED_FIELDS = frozenset(
    {
        "functions",
        "function_call",
        "logit_bias",
        "suffix",
        "best_of",
        "audio",
        "modalities",
        "prediction",
        "web_search_options",
        "reasoning_effort",
        "service_tier",
        "store",
        "metadata",
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
PositiveTokens = Annotated[int, Field(ge=1, le=2**31 - 1)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
Seed = Annotated[int, Field(ge=-_INT64, le=_INT64 - 1)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
PromptList = Annotated[list[Text], Field(max_length=64)]
StopString = Annotated[Text, Field(max_length=1024)]  # matched against the text's tail every step


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(OpenAIModel):
    name: Text = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: Text | None = None
    schema_: JsonObject | None = Field(default=None, alias="schema", description="none: any JSON object")
    strict: bool | None = Field(default=None, description="accepted; the schema is always enforced")


class ResponseFormat(OpenAIModel):
    """OpenAI's `response_format`: text (unconstrained), any JSON object, or JSON of a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsFields(OpenAIModel):
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


class SamplingFields(OpenAIModel):
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
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    min_tokens: int = Field(default=0, ge=0, le=2**31 - 1)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=64)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)
    cache_salt: Text | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="isolates prefix-cache sharing: requests only share cached blocks with equal salts",
    )
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None


class CompletionRequest(SamplingFields):
    prompt: Text | PromptList | list[TokenId] | Annotated[list[list[TokenId]], Field(max_length=64)] = Field(
        description="a string, a list of strings, token ids, or a list of token id lists"
    )
    max_tokens: PositiveTokens | None = Field(default=16, description="default 16")
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_special_tokens: bool = True


class TextContentPart(OpenAIModel):
    type: Literal["text"]
    text: Text


# OpenAI's function names: what a call's "name" may hold.
FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
MAX_TOOLS = 128


class FunctionCallParam(OpenAIModel):
    name: Text = Field(min_length=1, max_length=64)
    arguments: Text = Field(max_length=256 * 1024, description="the call's arguments as JSON text")


class ToolCallParam(OpenAIModel):
    """A call in an assistant message of the history."""

    id: Text = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextContentPart] | None = None
    name: Text | None = Field(default=None, max_length=256)
    tool_calls: Annotated[list[ToolCallParam], Field(max_length=MAX_TOOLS)] | None = None  # assistant
    tool_call_id: Text | None = Field(default=None, min_length=1, max_length=256)  # tool: the call answered
    reasoning_content: Text | None = None  # accepted when a client sends an answer back; not rendered


class FunctionDefinition(OpenAIModel):
    name: Text = Field(pattern=FUNCTION_NAME_PATTERN)
    description: Text | None = Field(default=None, max_length=64 * 1024)
    parameters: JsonObject | None = Field(default=None, description="a JSON schema; none: no arguments")
    strict: bool | None = Field(default=None, description="accepted; required and named calls are enforced")


class ChatTool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: Text = Field(min_length=1, max_length=64)


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: NamedFunction


def _tool_choice_kind(value) -> str | None:
    if isinstance(value, str):
        return "tool-choice-mode"
    return "tool-choice-function" if isinstance(value, dict) else None


# A string is a mode, an object names a function: only that branch's errors are reported.
ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("tool-choice-mode")]
    | Annotated[NamedToolChoice, Tag("tool-choice-function")],
    Discriminator(
        _tool_choice_kind,
        custom_error_type="tool_choice_type",
        custom_error_message="must be 'none', 'auto', 'required' or an object naming a function",
    ),
]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: Annotated[list[ChatTool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = Field(
        default=None, description="default: auto when the server enables it and tools are given, else none"
    )
    parallel_tool_calls: bool | None = Field(default=None, description="false: one call at most")
    chat_template_kwargs: JsonObject | None = Field(
        default=None, description='extra variables for the chat template, e.g. {"enable_thinking": false}'
    )
    max_completion_tokens: PositiveTokens | None = None
    max_tokens: PositiveTokens | None = Field(default=None, description="deprecated: max_completion_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False


class TokenizeCompletionRequest(OpenAIModel):
    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True


class TokenizeChatRequest(OpenAIModel):
    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    tools: Annotated[list[ChatTool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    chat_template_kwargs: JsonObject | None = None


def _tokenize_kind(body) -> str:
    return "chat-request" if isinstance(body, dict) and "messages" in body else "prompt-request"


# A body with "messages" is a chat; anything else must be a prompt. Choosing the branch up front
# reports only that branch's errors; the tags are listed so error locations can drop them.
TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("prompt-request")]
    | Annotated[TokenizeChatRequest, Tag("chat-request")],
    Discriminator(_tokenize_kind),
]
UNION_TAGS = frozenset({"prompt-request", "chat-request", "tool-choice-mode", "tool-choice-function"})


class DetokenizeRequest(OpenAIModel):
    model: Text | None = None
    tokens: list[TokenId]


# -- responses -------------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "xlaserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _drop_nones(self, handler):  # chunks without thinking or calls look as they always did
        return without_nones(handler, self, ("reasoning_content", "tool_calls"))


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
