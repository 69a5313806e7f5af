"""Anthropic's Messages API shapes (pydantic): requests strict like the OpenAI routes' (unknown fields,
wrong JSON types and invalid Unicode are 400s naming the field), responses and stream events as
Anthropic documents them.

A message's `content` (and `system`, and a tool result's `content`) may be a string or a list of
blocks; a string is read as one text block, so an error inside a block is named down to its field
(`messages[0].content[1].input`). Blocks are told apart by `type` through tags that error locations
drop (`ANTHROPIC_TAGS`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field

from xlaserve.entrypoints.serving.protocol import (
    JsonObject,
    KVTransferParams,
    OmitsNones,
    StopString,
    StrictModel,
    Text,
    type_union,
)

MAX_TOOLS = 128
MAX_STOP_SEQUENCES = 16
MAX_MCP_SERVERS = 16
TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


def _text_as_blocks(value):
    """A plain string stands for one text block."""
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


class CacheControl(StrictModel):
    """Accepted so clients may send it; prefix caching here is automatic."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlockParam(StrictModel):
    type: Literal["text"]
    text: Text
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = Field(default=None, description="accepted and ignored")


class ToolUseBlockParam(StrictModel):
    """A call the assistant made earlier in the conversation."""

    type: Literal["tool_use"]
    id: Text = Field(min_length=1, max_length=256)
    name: Text = Field(pattern=TOOL_NAME_PATTERN)
    input: JsonObject
    cache_control: CacheControl | None = None


TextBlocks = Annotated[list[TextBlockParam], BeforeValidator(_text_as_blocks)]


class ToolResultBlockParam(StrictModel):
    """The result of the tool_use with id `tool_use_id`, sent in the next user message."""

    type: Literal["tool_result"]
    tool_use_id: Text = Field(min_length=1, max_length=256)
    content: TextBlocks | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class McpToolUseBlockParam(StrictModel):
    """A call of an MCP server's tool that this server made in an earlier answer (sent back as it came)."""

    type: Literal["mcp_tool_use"]
    id: Text = Field(min_length=1, max_length=256)
    name: Text = Field(min_length=1, max_length=128)
    server_name: Text = Field(min_length=1, max_length=64)
    input: JsonObject
    cache_control: CacheControl | None = None


class McpToolResultBlockParam(ToolResultBlockParam):
    """The result of the mcp_tool_use with id `tool_use_id`, in the same assistant message after it."""

    type: Literal["mcp_tool_result"]


class ThinkingBlockParam(StrictModel):
    type: Literal["thinking"]
    thinking: Text
    signature: Text | None = None


class RedactedThinkingBlockParam(StrictModel):
    type: Literal["redacted_thinking"]
    data: Text


class Base64ImageSource(StrictModel):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str = Field(max_length=32 * 1024 * 1024)


class URLImageSource(StrictModel):
    type: Literal["url"]
    url: str = Field(max_length=8192)


_SOURCES = {"base64": Base64ImageSource, "url": URLImageSource}
ImageSource = type_union(_SOURCES, "source")


class ImageBlockParam(StrictModel):
    """An image for a vision-language model (engine/engine/media.py: where it may come from)."""

    type: Literal["image"]
    source: ImageSource
    cache_control: CacheControl | None = None


_BLOCKS = {
    "text": TextBlockParam,
    "tool_use": ToolUseBlockParam,
    "tool_result": ToolResultBlockParam,
    "thinking": ThinkingBlockParam,
    "redacted_thinking": RedactedThinkingBlockParam,
    "image": ImageBlockParam,
    "mcp_tool_use": McpToolUseBlockParam,
    "mcp_tool_result": McpToolResultBlockParam,
}


ContentBlock = type_union(_BLOCKS, "block")


class MessageParam(StrictModel):
    role: Literal["user", "assistant"]
    content: Annotated[list[ContentBlock], BeforeValidator(_text_as_blocks)]


class ToolParam(StrictModel):
    name: Text = Field(pattern=TOOL_NAME_PATTERN)
    description: Text | None = None
    input_schema: JsonObject = Field(description="a JSON schema of the tool's input, an object")
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = Field(
        default=None, description="accepted, as on OpenAI's function tools: forced calls follow the schema"
    )
    eager_input_streaming: bool | None = Field(
        default=None, description="accepted; a tool_use's input always streams as it is generated"
    )


class ToolChoiceAuto(StrictModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(StrictModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(StrictModel):
    type: Literal["tool"]
    name: Text = Field(pattern=TOOL_NAME_PATTERN)
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(StrictModel):
    type: Literal["none"]


_CHOICES = {"auto": ToolChoiceAuto, "any": ToolChoiceAny, "tool": ToolChoiceTool, "none": ToolChoiceNone}


ToolChoice = type_union(_CHOICES, "choice")


class Metadata(StrictModel):
    user_id: Text | None = Field(default=None, max_length=256, description="accepted and ignored")


class ThinkingEnabled(StrictModel):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1, le=2**31 - 1, description="accepted; the thinking is not cut")


class ThinkingAdaptive(StrictModel):
    """The model decides how much to think: here as "enabled" without a budget."""

    type: Literal["adaptive"]


class ThinkingDisabled(StrictModel):
    type: Literal["disabled"]


_THINKING = {"enabled": ThinkingEnabled, "adaptive": ThinkingAdaptive, "disabled": ThinkingDisabled}
Thinking = type_union(_THINKING, "thinking")
# The union tags above: not fields, so error locations leave them out (a plain discriminated union's
# tag is the type's value, "thinking.enabled.budget_tokens": a field the client never sent).
_UNIONS = {"block": _BLOCKS, "choice": _CHOICES, "source": _SOURCES, "thinking": _THINKING}
ANTHROPIC_TAGS = frozenset(
    {f"{kind}-{suffix}" for suffix, members in _UNIONS.items() for kind in [*members, "unknown"]}
)


class JsonOutputFormat(StrictModel):
    """Structured output: the answer is JSON that validates against `schema` (the structured-output
    backend constrains every token)."""

    type: Literal["json_schema"]
    schema_: JsonObject = Field(alias="schema")


class OutputConfig(StrictModel):
    format: JsonOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = Field(
        default=None, description="accepted and ignored"
    )


class McpToolConfiguration(StrictModel):
    enabled: bool = Field(default=True, description="false: none of the server's tools is offered")
    allowed_tools: (
        Annotated[list[Annotated[Text, Field(pattern=TOOL_NAME_PATTERN)]], Field(max_length=MAX_TOOLS)] | None
    ) = Field(
        default=None, description="the tools offered (default: all); a name the server lacks is left out"
    )


class McpServerParam(StrictModel):
    """An MCP server whose tools this server lists, offers to the model and calls itself (Anthropic's MCP
    connector, beta mcp-client-2025-04-04). Only servers named by --tool-server."""

    type: Literal["url"]
    url: Text = Field(min_length=1, max_length=2048, description="http(s)://HOST:PORT/path")
    name: Text = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    # Sent as 'Authorization: Bearer ...' with every request to the MCP server; never echoed.
    authorization_token: Text | None = Field(default=None, max_length=8192, pattern=r"^[^\r\n\x00]*$")
    tool_configuration: McpToolConfiguration | None = None


class CountTokensRequest(StrictModel):
    """POST /v1/messages/count_tokens: the prompt a /v1/messages request with these fields would have."""

    model: Text
    messages: list[MessageParam] = Field(min_length=1)
    system: TextBlocks | None = None
    tools: list[ToolParam] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = Field(
        default=None,
        description='the template is rendered with enable_thinking true ("enabled", "adaptive") or false '
        '("disabled"); the --reasoning-parser, if any, splits the thinking into a thinking block',
    )
    output_config: OutputConfig | None = None
    mcp_servers: list[McpServerParam] | None = Field(default=None, max_length=MAX_MCP_SERVERS)
    cache_control: CacheControl | None = Field(
        default=None, description="Anthropic's automatic caching: accepted; prefix caching here always is"
    )
    speed: Literal["standard", "fast"] | None = Field(default=None, description="accepted and ignored")
    # vLLM's extra, not Anthropic's
    chat_template_kwargs: JsonObject | None = Field(
        default=None,
        description="extra variables for the chat template and the reasoning parser, as on the chat "
        "route; `thinking`, when sent, sets enable_thinking over them",
    )


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(
        ge=0,
        le=2**31 - 1,
        description="0: the prompt is run and its blocks cached, nothing generated (Anthropic's cache "
        "pre-warming): no content, stop_reason max_tokens",
    )
    stop_sequences: list[StopString] | None = Field(default=None, max_length=MAX_STOP_SEQUENCES)
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0, description="default 1.0")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=2**31 - 1, description="0: off")
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = Field(
        default=None, description="accepted and ignored: one tier here"
    )
    inference_geo: Text | None = Field(
        default=None, max_length=64, description="accepted and ignored: inference runs on this server"
    )
    kv_transfer_params: KVTransferParams | None = Field(
        default=None,
        description="vLLM's disaggregated prefill (README), as on the chat route; not with mcp_servers",
    )
    cache_salt: Text | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="vLLM's, as on the chat route: requests share prefix-cached blocks only with equal salts",
    )


# -- responses -------------------------------------------------------------------------------------


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingBlock(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = Field(default="", description="empty: this server does not sign its thinking")


class McpToolUseBlock(ToolUseBlock):
    """A call the model made of an MCP server's tool (`server_name`), made by this server."""

    type: Literal["mcp_tool_use"] = "mcp_tool_use"
    server_name: str


class McpToolResultBlock(BaseModel):
    type: Literal["mcp_tool_result"] = "mcp_tool_result"
    tool_use_id: str = Field(description="the id of the mcp_tool_use block it answers")
    is_error: bool = Field(description="the tool reported an error, or the call could not be made")
    content: list[TextBlock] = Field(description="what the MCP server answered, as one text block")


ResponseBlock = TextBlock | ToolUseBlock | ThinkingBlock | McpToolUseBlock | McpToolResultBlock
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Usage(OmitsNones):
    # Anthropic's buckets add up to the prompt (count_tokens): input_tokens is the part the prefix cache
    # neither held nor now holds (its last, partial block). vLLM's fields and split, and as vLLM's, the
    # cache's two buckets only with --enable-prompt-tokens-details, left out otherwise (input_tokens then
    # the whole prompt); no service_tier (vLLM reports none; the SDKs read it as None).
    input_tokens: int = Field(description="the prompt's tokens neither read from nor written to the cache")
    output_tokens: int
    cache_creation_input_tokens: int | None = Field(
        default=None,
        description="the prompt's tokens written to the prefix cache (its whole blocks past the hit)",
    )
    cache_read_input_tokens: int | None = Field(
        default=None, description="the prompt's tokens the prefix cache held"
    )

    omit_if_none = ("cache_creation_input_tokens", "cache_read_input_tokens")

    @classmethod
    def of(cls, num_prompt: int, num_generated: int, output, with_details: bool) -> Usage:
        """`output` (a RequestOutput, or a stream's Turn) says what the prefix cache held and gained."""
        if not with_details:
            return cls(input_tokens=num_prompt, output_tokens=num_generated)
        num_cached, num_created = output.num_cached_tokens, output.num_cache_creation_tokens
        return cls(
            input_tokens=num_prompt - num_cached - num_created,
            output_tokens=num_generated,
            cache_creation_input_tokens=num_created,
            cache_read_input_tokens=num_cached,
        )


class MessagesResponse(OmitsNones):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[ResponseBlock]
    model: str
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: Usage
    # A disaggregated-prefill producer's (vLLM's field, as on the chat route): where a consumer fetches
    # the prompt's blocks; left out of every other message.
    kv_transfer_params: dict[str, Any] | None = None

    # vLLM's one-shot reply leaves every null out (its exclude_none): no stop string matched, no
    # stop_sequence. The stream's message_delta keeps its null, as vLLM's and Anthropic's.
    omit_if_none = ("stop_reason", "stop_sequence", "kv_transfer_params")


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo
