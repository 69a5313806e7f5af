"""The Responses API's response object and its output items, as OpenAI documents them (what
POST /v1/responses returns and GET /v1/responses/{id} reads back; the request is responses_protocol.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from xlaserve.entrypoints.openai.responses_input import ItemStatus
from xlaserve.entrypoints.serving.protocol import OmitsNones, ServiceTier


class OutputTextPart(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputTextPart]


class FunctionCallOutput(BaseModel):
    """A call the model made (a `function_call` output item)."""

    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus = "completed"


class ReasoningTextPart(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningOutput(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ReasoningTextPart]
    status: ItemStatus = "completed"


class McpToolInfo(BaseModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    annotations: dict[str, Any] | None = None


class McpListToolsOutput(BaseModel):
    """The tools an MCP server offered (an `mcp_list_tools` output item), allowed_tools applied."""

    type: Literal["mcp_list_tools"] = "mcp_list_tools"
    id: str
    server_label: str
    tools: list[McpToolInfo]


class McpCallOutput(BaseModel):
    """A call of an MCP server's tool the server made for the model (an `mcp_call` output item)."""

    type: Literal["mcp_call"] = "mcp_call"
    id: str
    server_label: str
    name: str
    arguments: str
    output: str | None = None
    error: str | None = None
    status: ItemStatus = "completed"
    approval_request_id: str | None = None  # the request the client approved, for a call that waited


class McpApprovalRequestOutput(BaseModel):
    """A call the model made that waits for the client (an `mcp_approval_request` output item): the
    client answers with an `mcp_approval_response` naming its id, and the server then makes it or not."""

    type: Literal["mcp_approval_request"] = "mcp_approval_request"
    id: str
    server_label: str
    name: str
    arguments: str


OutputItem = (
    OutputMessage
    | FunctionCallOutput
    | ReasoningOutput
    | McpListToolsOutput
    | McpCallOutput
    | McpApprovalRequestOutput
)


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    # Required by the SDKs' ResponseUsage (openai 3.x). OpenAI bills writing a prompt to its cache; the
    # prefix cache here keeps blocks at no extra cost and the answer reports none.
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class Response(OmitsNones):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    store: bool = True
    temperature: float = 1.0
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float = 1.0
    truncation: Literal["auto", "disabled"] = "disabled"
    service_tier: ServiceTier = "auto"  # the request's, echoed as vLLM does
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    background: bool | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    # A disaggregated-prefill producer's: where a consumer fetches the prompt's blocks (vLLM's, as on
    # the chat route); left out of every other response.
    kv_transfer_params: dict[str, Any] | None = None

    omit_if_none = ("kv_transfer_params",)


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
