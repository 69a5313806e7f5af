"""OpenAI's Responses API request (pydantic): POST /v1/responses, strict like the chat request (unknown
fields, wrong JSON types and invalid Unicode are 400s naming the field). The response object and its
output items are responses_output.py.

`input` is a string or a list of items (responses_input.py). Items, parts, tools and text formats are told
apart by `type` through tags that error locations drop (`RESPONSES_TAGS`), so an error names
`input[2].call_id`, not a branch.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Discriminator, Field, Tag

from xlaserve.entrypoints.openai.responses_input import (
    INPUT_ITEMS,
    INPUT_PARTS,
    MAX_INPUT_ITEMS,
    InputItem,
    ItemId,
)
from xlaserve.entrypoints.serving.chat_protocol import FUNCTION_NAME_PATTERN, MAX_TOOLS, ReasoningEffort
from xlaserve.entrypoints.serving.protocol import (
    JsonObject,
    KVTransferParams,
    Metadata,
    Penalty,
    PositiveTokens,
    Seed,
    ServiceTier,
    StopString,
    StrictModel,
    Text,
    TokenId,
    mode_or_function,
    type_union,
)

OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the one `include` value that adds to the response
Includable = Literal[
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
]
MAX_METADATA_KEYS = 16


# -- tools and formats --------------------------------------------------------------------------------


class FunctionTool(StrictModel):
    """The Responses API's flat function tool (the chat API nests these under "function")."""

    type: Literal["function"]
    name: Text = Field(pattern=FUNCTION_NAME_PATTERN)
    description: Text | None = Field(default=None, max_length=64 * 1024)
    parameters: JsonObject | None = Field(default=None, description="a JSON schema; none: no arguments")
    strict: bool | None = Field(default=None, description="accepted; required and named calls are enforced")


class McpToolFilter(StrictModel):
    """Tools by name, or those the MCP server marks read-only (its `readOnlyHint` annotation)."""

    tool_names: (
        Annotated[list[Annotated[Text, Field(pattern=FUNCTION_NAME_PATTERN)]], Field(max_length=MAX_TOOLS)]
        | None
    ) = None
    read_only: bool | None = None


class McpApprovalFilter(StrictModel):
    """`always`: the tools whose calls wait for approval; `never`: those made at once (the rest wait)."""

    always: McpToolFilter | None = None
    never: McpToolFilter | None = None


ApprovalRule = Annotated[
    Annotated[Literal["never", "always"], Tag("approval-mode")]
    | Annotated[McpApprovalFilter, Tag("approval-filter")],
    Discriminator(
        lambda value: "approval-mode" if isinstance(value, str) else "approval-filter",
    ),
]


class McpTool(StrictModel):
    """A remote MCP server's tools (OpenAI's `mcp` tool): the server lists them, offers them to the model
    as functions and calls them itself, over streamable HTTP. Only servers named by --tool-server."""

    type: Literal["mcp"]
    server_label: Text = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    server_url: Text = Field(min_length=1, max_length=2048, description="http(s)://HOST:PORT/path")
    server_description: Text | None = Field(default=None, max_length=4096)
    allowed_tools: (
        Annotated[list[Annotated[Text, Field(pattern=FUNCTION_NAME_PATTERN)]], Field(max_length=MAX_TOOLS)]
        | None
    ) = None
    require_approval: ApprovalRule | None = Field(
        default=None,
        description="which calls wait for the client's mcp_approval_response (default: never, none do)",
    )
    # Sent with every request to the MCP server (an API key, say); never echoed in the response.
    # Each name and value is checked where the tools are read (mcp_tools.mcp_tools_of), naming the header.
    headers: Annotated[dict[Text, Text], Field(max_length=32)] | None = None
    authorization: Text | None = Field(
        default=None,
        max_length=8192,
        pattern=r"^[^\r\n\x00]*$",
        description="sent as 'Authorization: Bearer ...'",
    )


MCP_SECRETS = {"headers", "authorization"}  # an MCP tool's fields the response object leaves out


_TOOLS = {"function": FunctionTool, "mcp": McpTool}


Tool = type_union(_TOOLS, "tool")


class NamedFunctionChoice(StrictModel):
    type: Literal["function"]
    name: Text = Field(min_length=1, max_length=64)


ToolChoice = mode_or_function(
    NamedFunctionChoice,
    "responses-choice",
    "must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
)


class TextFormat(StrictModel):
    type: Literal["text"]


class JsonObjectFormat(StrictModel):
    type: Literal["json_object"]


class JsonSchemaFormat(StrictModel):
    """The Responses API's flat json_schema format (the chat API nests it under "json_schema")."""

    type: Literal["json_schema"]
    name: Text = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    schema_: JsonObject = Field(alias="schema")
    description: Text | None = None
    strict: bool | None = Field(default=None, description="accepted; the schema is always enforced")


_FORMATS = {"text": TextFormat, "json_object": JsonObjectFormat, "json_schema": JsonSchemaFormat}


Format = type_union(_FORMATS, "format")


class TextConfig(StrictModel):
    format: Format | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(
        default=None, description="accepted and ignored"
    )


class ReasoningConfig(StrictModel):
    """Accepted: a --reasoning-parser splits the thinking of models that think; effort is not enforced."""

    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(StrictModel):
    include_obfuscation: bool | None = Field(default=None, description="accepted; events are not padded")


def _input_kind(value) -> str | None:
    if isinstance(value, str):
        return "input-text"
    return "input-items" if isinstance(value, list) else None


# A string is one user message, a list holds items: only that branch's errors are reported.
Input = Annotated[
    Annotated[Text, Tag("input-text")]
    | Annotated[list[InputItem], Field(max_length=MAX_INPUT_ITEMS), Tag("input-items")],
    Discriminator(
        _input_kind,
        custom_error_type="input_type",
        custom_error_message="must be a string or a list of input items",
    ),
]
RESPONSES_TAGS = frozenset(
    {f"{kind}-part" for kind in INPUT_PARTS}
    | {f"{kind}-item" for kind in INPUT_ITEMS}
    | {f"{kind}-format" for kind in _FORMATS}
    | {f"{kind}-tool" for kind in _TOOLS}
    | {"unknown-part", "unknown-item", "unknown-format", "unknown-tool"}
    | {"responses-choice-mode", "responses-choice-function"}
    | {"input-text", "input-items", "text-value", "list-value"}
    | {"approval-mode", "approval-filter"}
)


class ResponsesRequest(StrictModel):
    """POST /v1/responses: OpenAI's fields, then vLLM's sampling extras (as on the chat route)."""

    model: Text | None = Field(default=None, description="the served model name (optional)")
    input: Input
    instructions: Text | None = Field(default=None, description="a system message; not carried over")
    previous_response_id: ItemId | None = None
    store: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_output_tokens: PositiveTokens | None = Field(default=None, description="default: up to the context")
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, description="default 1.0")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = Field(
        default=None, description="default: auto when the server enables it and tools are given, else none"
    )
    parallel_tool_calls: bool | None = Field(default=None, description="false: one call at most")
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include_reasoning: bool = Field(
        default=True,
        description="vLLM's: false leaves the reasoning items out of the output (the model still thinks, "
        "and usage counts those tokens)",
    )
    metadata: Metadata | None = None
    user: Text | None = Field(default=None, max_length=256, description="accepted and ignored")
    truncation: Literal["auto", "disabled"] | None = Field(
        default=None,
        description="auto: a prompt past the context keeps its last tokens, room left for the answer "
        "(vLLM's truncate_prompt_tokens -1); disabled (the default): it is a 400",
    )
    background: bool | None = Field(
        default=None, description="answer at once, queued; generate in the server's background (poll GET)"
    )
    include: Annotated[list[Includable], Field(max_length=16)] | None = Field(
        default=None,
        description=f"{OUTPUT_LOGPROBS!r}: the message text's token logprobs; the others add nothing",
    )
    top_logprobs: int | None = Field(
        default=None,
        ge=-1,
        description=f"alternatives per token, with {OUTPUT_LOGPROBS!r} (-1: the whole vocabulary, vLLM's)",
    )
    max_tool_calls: int | None = Field(
        default=None, ge=0, le=2**31 - 1, description="echoed and otherwise ignored, as vLLM does"
    )
    service_tier: ServiceTier | None = Field(
        default=None, description="accepted and echoed (default auto), as vLLM does: one tier here"
    )
    prompt_cache_key: Text | None = Field(default=None, max_length=256, description="accepted and ignored")
    safety_identifier: Text | None = Field(default=None, max_length=256, description="accepted and ignored")
    # vLLM's extras
    request_id: Text | None = Field(
        default=None,
        description="the engine's id for the response, echoed as the answer's X-Request-Id header (an "
        "X-Request-Id header wins, as on the chat route); 1 to 128 printable ASCII characters. The "
        "response's `id` stays the server's resp_ id: the store's key, never a client's",
    )
    chat_template_kwargs: JsonObject | None = Field(
        default=None,
        description="extra variables for the chat template and the reasoning parser, as on the chat route, "
        'e.g. {"enable_thinking": false}',
    )
    seed: Seed | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=16)] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    min_tokens: int = Field(default=0, ge=0, le=2**31 - 1)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=64)
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)
    cache_salt: Text | None = Field(default=None, min_length=1, max_length=256)
    kv_transfer_params: KVTransferParams | None = Field(
        default=None, description="disaggregated prefill's (README): as on the chat route; not with mcp tools"
    )
