"""The chat request (`ChatCompletionRequest`): its messages and their content parts, tools and tool
choice, over the sampling fields every generating route shares (serving/protocol.py).

It is the server's one chat path: OpenAI's route validates it from the body, Anthropic's /v1/messages
converts its own request into it. So templating, tool planning, structured outputs and SamplingParams
are written once, against this model, and neither API package imports the other.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from xlaserve.entrypoints.serving.protocol import (
    CHAT_TEMPLATE_HELP,
    ChatTemplate,
    JsonObject,
    Metadata,
    PositiveTokens,
    SamplingFields,
    ServiceTier,
    StrictModel,
    Text,
    mode_or_function,
    text_or_list,
    type_union,
)


class TextContentPart(StrictModel):
    type: Literal["text"]
    text: Text


class ImageURL(StrictModel):
    url: str = Field(
        max_length=32 * 1024 * 1024, description="a data: URL, or an allowed file:// or http(s):// URL"
    )
    detail: Literal["auto", "low", "high"] | None = None  # accepted (OpenAI's); the processor decides


# vLLM's `uuid` of a media part: names the media, so a later part can send the uuid alone (its image_url
# or video_url null) for the media last sent under it (engine/engine/media_uuids.py). Not trusted as a
# cache key: the media's content hash keys ours (core/multimodal.py), so two images under one uuid stay two.
MediaUUID = Annotated[
    Text | None,
    Field(
        min_length=1, max_length=256, description="names the media; a part of it alone names the last sent"
    ),
]


class ImageURLContentPart(StrictModel):
    """An image for a vision-language model (engine/engine/media.py: where it may come from)."""

    type: Literal["image_url"]
    image_url: ImageURL | None = Field(default=None, description="null: the image last sent under `uuid`")
    uuid: MediaUUID = None


class VideoURL(StrictModel):
    url: str = Field(
        max_length=32 * 1024 * 1024, description="a data: URL, or an allowed file:// or http(s):// URL"
    )


class VideoURLContentPart(StrictModel):
    """A video for a model that takes them (Qwen2.5-VL; vLLM's part): decoded and sampled in the front end
    (engine/engine/video.py)."""

    type: Literal["video_url"]
    video_url: VideoURL | None = Field(default=None, description="null: the video last sent under `uuid`")
    uuid: MediaUUID = None


CONTENT_PARTS = {"text": TextContentPart, "image_url": ImageURLContentPart, "video_url": VideoURLContentPart}
ContentPart = type_union(CONTENT_PARTS, "part")


# OpenAI's function names: what a call's "name" may hold.
FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
MAX_TOOLS = 128


class FunctionCallParam(StrictModel):
    name: Text = Field(min_length=1, max_length=64)
    arguments: Text = Field(max_length=256 * 1024, description="the call's arguments as JSON text")


class ToolCallParam(StrictModel):
    """A call in an assistant message of the history."""

    id: Text = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: text_or_list(ContentPart) | None = None
    name: Text | None = Field(default=None, max_length=256)
    tool_calls: Annotated[list[ToolCallParam], Field(max_length=MAX_TOOLS)] | None = None  # assistant
    tool_call_id: Text | None = Field(default=None, min_length=1, max_length=256)  # tool: the call answered
    reasoning_content: Text | None = None  # an answer's thinking sent back: `thinking` to gpt-oss's template


class FunctionDefinition(StrictModel):
    name: Text = Field(pattern=FUNCTION_NAME_PATTERN)
    description: Text | None = Field(default=None, max_length=64 * 1024)
    parameters: JsonObject | None = Field(default=None, description="a JSON schema; none: no arguments")
    strict: bool | None = Field(default=None, description="accepted; required and named calls are enforced")


class ChatTool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: Text = Field(min_length=1, max_length=64)


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


# A string is a mode, an object names a function: only that branch's errors are reported.
ToolChoice = mode_or_function(
    NamedToolChoice, "tool-choice", "must be 'none', 'auto', 'required' or an object naming a function"
)


# OpenAI's reasoning effort levels (the chat request's `reasoning_effort`, the Responses API's
# `reasoning.effort`).
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


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
    chat_template: ChatTemplate | None = Field(default=None, description=CHAT_TEMPLATE_HELP)
    mm_processor_kwargs: JsonObject | None = Field(
        default=None,
        description="the multimodal processor's settings for this request (vLLM's; the Qwen VL families' "
        "min_pixels, max_pixels and fps), over the server's --mm-processor-kwargs",
    )
    max_completion_tokens: PositiveTokens | None = None
    max_tokens: PositiveTokens | None = Field(default=None, description="deprecated: max_completion_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=-1, description="-1: the whole vocabulary (vLLM's)")
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    include_reasoning: bool = Field(
        default=True, description="false: the answer leaves out the reasoning parser's reasoning_content"
    )
    reasoning_effort: ReasoningEffort | None = Field(
        default=None,
        description="the chat template's `reasoning_effort` variable, as vLLM passes it (gpt-oss's template "
        "reads it; others ignore it); a chat_template_kwargs entry of that name wins",
    )
    verbosity: Literal["low", "medium", "high"] | None = Field(
        default=None, description="accepted and ignored"
    )
    prompt_cache_key: Text | None = Field(default=None, max_length=256, description="accepted and ignored")
    safety_identifier: Text | None = Field(default=None, max_length=256, description="accepted and ignored")
    # OpenAI's stored completions and processing tiers: vLLM accepts these and ignores them, as we do.
    metadata: Metadata | None = Field(default=None, description="accepted and ignored")
    store: bool | None = Field(default=None, description="accepted and ignored: nothing is stored")
    service_tier: ServiceTier | None = Field(default=None, description="accepted and ignored")

    @property
    def template_variables(self) -> dict | None:
        """The chat template's extra variables: chat_template_kwargs, with `reasoning_effort` beneath them."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}


# The tool_choice union's tags: not fields, so error locations leave them out.
UNION_TAGS = frozenset(
    {"tool-choice-mode", "tool-choice-function", "text-value", "list-value", "unknown-part"}
    | {f"{kind}-part" for kind in CONTENT_PARTS}
)
