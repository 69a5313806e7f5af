"""The Responses API's `input` (pydantic, strict as the request in responses_protocol.py): a string (one user
message) or a list of items: messages (role user, system, developer or assistant; content a string or
`input_text`/`output_text` parts, and `input_image` parts and chat's `video_url` parts in a user message:
OpenAI's Responses API defines no video part), `function_call` (a call the model made earlier),
`function_call_output` (its result), `reasoning` (accepted when a client sends its output back; not shown
to the model) and the MCP items. Items and parts are told apart by `type` through tags that error
locations drop (responses_protocol.py `RESPONSES_TAGS`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from xlaserve.entrypoints.serving.chat_protocol import FUNCTION_NAME_PATTERN, MAX_TOOLS, VideoURLContentPart
from xlaserve.entrypoints.serving.protocol import StrictModel, Text, text_or_list, type_union

MAX_INPUT_ITEMS = 4096
ItemStatus = Literal["in_progress", "completed", "incomplete"]
ItemId = Annotated[Text, Field(min_length=1, max_length=256)]

# -- input ------------------------------------------------------------------------------------------


class InputText(StrictModel):
    type: Literal["input_text"]
    text: Text


class OutputText(StrictModel):
    """An assistant's text sent back (a previous response's output)."""

    type: Literal["output_text"]
    text: Text
    annotations: list[dict[str, Any]] | None = Field(default=None, description="accepted and ignored")
    logprobs: list[dict[str, Any]] | None = Field(default=None, description="accepted and ignored")


class InputImage(StrictModel):
    """An image in a user message (a vision-language model): `image_url` a data: URL, or an http(s) or
    file: URL where the server allows it (--allowed-media-domains, --allowed-local-media-path).
    `file_id` (OpenAI's Files API) is not served here: a 400 naming it."""

    type: Literal["input_image"]
    image_url: Text | None = None
    file_id: Text | None = None
    detail: Literal["low", "high", "auto"] = "auto"


# A video is chat's part (vLLM's `video_url`) in a Responses message: OpenAI's API names none.
INPUT_PARTS = {
    "input_text": InputText,
    "output_text": OutputText,
    "input_image": InputImage,
    "video_url": VideoURLContentPart,
}


ContentPart = type_union(INPUT_PARTS, "part")


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: text_or_list(ContentPart, MAX_INPUT_ITEMS)
    id: ItemId | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = Field(
        default=None, description="an assistant message's, as OpenAI's output gives it: accepted and ignored"
    )


class Caller(StrictModel):
    """What made a call: the model (`direct`) or a program item's code (OpenAI's `program`)."""

    type: Literal["direct", "program"]
    caller_id: ItemId | None = None


class _CallContext(StrictModel):
    """A call's context fields that the newest SDKs' output items carry (null where unset), so an item
    sent back as the SDK dumps it keeps them: accepted and ignored, as vLLM ignores them."""

    namespace: Text | None = Field(default=None, max_length=256)
    caller: Caller | None = None


class FunctionCallItem(_CallContext):
    """A call the model made earlier: `call_id` is what its function_call_output answers."""

    type: Literal["function_call"]
    call_id: ItemId
    name: Text = Field(pattern=FUNCTION_NAME_PATTERN)
    arguments: Text = Field(max_length=256 * 1024, description="the call's arguments as JSON text")
    id: ItemId | None = None
    status: ItemStatus | None = None
    is_async: bool | None = Field(default=None, alias="async", description="accepted and ignored")


class FunctionCallOutputItem(_CallContext):
    type: Literal["function_call_output"]
    call_id: ItemId
    output: text_or_list(InputText, MAX_INPUT_ITEMS)
    id: ItemId | None = None
    status: ItemStatus | None = None
    name: Text | None = Field(default=None, max_length=256, description="accepted and ignored")


class SummaryText(StrictModel):
    type: Literal["summary_text"]
    text: Text


class ReasoningText(StrictModel):
    type: Literal["reasoning_text"]
    text: Text


class ReasoningItem(StrictModel):
    """A previous response's reasoning sent back: its `content` is the thinking of the assistant turn
    it begins (the template decides whether the model sees it: gpt-oss's shows the thinking before a
    call not yet answered by a final message); `summary` and `encrypted_content` are not shown."""

    type: Literal["reasoning"]
    id: ItemId | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: Text | None = None
    status: ItemStatus | None = None


class McpListToolsItem(StrictModel):
    """An earlier response's listing sent back: accepted, not shown to the model (the tools are listed
    again for this response)."""

    type: Literal["mcp_list_tools"]
    id: ItemId | None = None
    server_label: Text
    tools: list[dict[str, Any]] = Field(default_factory=list, max_length=MAX_TOOLS)
    error: Text | None = None


class McpApprovalRequestItem(StrictModel):
    """A call the model made that waits for the client's approval (an earlier response's output)."""

    type: Literal["mcp_approval_request"]
    id: ItemId
    server_label: Text
    name: Text = Field(pattern=FUNCTION_NAME_PATTERN)
    arguments: Text = Field(max_length=256 * 1024)


class McpCallItem(McpApprovalRequestItem):
    """An MCP call the server made earlier, sent back: the model's call and its output (or error)."""

    type: Literal["mcp_call"]
    output: Text | None = None
    error: Text | None = None
    approval_request_id: ItemId | None = None
    status: Literal["in_progress", "completed", "incomplete", "calling", "failed"] | None = None


class McpApprovalResponseItem(StrictModel):
    """The client's answer to an mcp_approval_request: approved, the server makes the call."""

    type: Literal["mcp_approval_response"]
    approval_request_id: ItemId
    approve: bool
    reason: Text | None = Field(default=None, max_length=4096)
    id: ItemId | None = None


INPUT_ITEMS = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
    "mcp_list_tools": McpListToolsItem,
    "mcp_call": McpCallItem,
    "mcp_approval_request": McpApprovalRequestItem,
    "mcp_approval_response": McpApprovalResponseItem,
}


# An item without "type" is a message ({"role", "content"}: OpenAI's easy input message).
InputItem = type_union(INPUT_ITEMS, "item", default="message")
