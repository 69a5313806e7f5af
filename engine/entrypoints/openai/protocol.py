"""OpenAI's request and response shapes (pydantic) beyond the shared chat request
(serving/chat_protocol.py): completions, tokenize and detokenize, and every response and stream chunk."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, Discriminator, Field, Tag

from xlaserve.entrypoints.openai.tool_protocol import DeltaToolCallOut, ToolCallOut
from xlaserve.entrypoints.serving.chat_protocol import MAX_TOOLS, ChatMessage, ChatTool
from xlaserve.entrypoints.serving.protocol import (
    CHAT_TEMPLATE_HELP,
    ChatTemplate,
    JsonObject,
    OmitsNones,
    PromptList,
    SamplingFields,
    StrictModel,
    Text,
    TokenId,
)


class CompletionRequest(SamplingFields):
    prompt: Text | PromptList | list[TokenId] | Annotated[list[list[TokenId]], Field(max_length=64)] = Field(
        description="a string, a list of strings, token ids, or a list of token id lists"
    )
    max_tokens: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = Field(
        default=16, description="default 16; 0 only with echo: the prompt alone"
    )
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=-1, description="-1: the whole vocabulary (vLLM's)")
    add_special_tokens: bool = True


class TokenizeCompletionRequest(StrictModel):
    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool | None = False  # vLLM's: also answer each id's token string


class TokenizeChatRequest(StrictModel):
    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    tools: Annotated[list[ChatTool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    chat_template_kwargs: JsonObject | None = None
    chat_template: ChatTemplate | None = Field(default=None, description=CHAT_TEMPLATE_HELP)


def _tokenize_kind(body) -> str:
    return "chat-request" if isinstance(body, dict) and "messages" in body else "prompt-request"


# A body with "messages" is a chat; anything else must be a prompt. Choosing the branch up front
# reports only that branch's errors; the tags are listed so error locations can drop them.
TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("prompt-request")]
    | Annotated[TokenizeChatRequest, Tag("chat-request")],
    Discriminator(_tokenize_kind),
]
UNION_TAGS = frozenset({"prompt-request", "chat-request"})


class DetokenizeRequest(StrictModel):
    model: Text | None = None
    tokens: list[TokenId]


# -- responses -------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # the prompt's tokens the prefix cache served
    created_cache_tokens: int = 0  # the prompt's whole blocks it computed and added to the cache (vLLM's)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(
        cls, num_prompt: int, num_generated: int, num_cached: int, with_details: bool, num_created: int = 0
    ) -> UsageInfo:
        """`with_details`: --enable-prompt-tokens-details (the prefix cache's hit in the prompt, and the
        tokens the prompt added to it)."""
        details = PromptTokensDetails(cached_tokens=num_cached, created_cache_tokens=num_created)
        return cls(
            prompt_tokens=num_prompt,
            completion_tokens=num_generated,
            total_tokens=num_prompt + num_generated,
            prompt_tokens_details=details if with_details else None,
        )


class ModelPermission(BaseModel):
    """vLLM's (OpenAI's former) permission entry of a model card: what a client may do with the model."""

    id: str = Field(default_factory=lambda: f"modelperm-{uuid.uuid4().hex}")
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "xlaserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's Logprob in `prompt_logprobs`."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's `return_token_ids` and `prompt_logprobs` fields: present only when the request asks for them.
_ASKED_FOR = ("prompt_logprobs", "prompt_token_ids", "token_ids")


class CompletionChoice(OmitsNones):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None

    omit_if_none = _ASKED_FOR


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    # A disaggregated-prefill producer's: where a consumer fetches the prompt's blocks (vLLM's).
    kv_transfer_params: dict | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"  # --response-role, or the last message's role (add_generation_prompt off)
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(OmitsNones):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None

    omit_if_none = _ASKED_FOR


class ChatCompletionResponse(OmitsNones):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    # A disaggregated-prefill producer's: where a consumer fetches the prompt's blocks (vLLM's).
    kv_transfer_params: dict | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None

    omit_if_none = _ASKED_FOR


class DeltaMessage(OmitsNones):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCallOut] | None = None

    # Chunks without thinking or calls look as they always did.
    omit_if_none = ("reasoning_content", "tool_calls")


class ChatChunkChoice(OmitsNones):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None

    omit_if_none = _ASKED_FOR


class ChatCompletionChunk(OmitsNones):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # the first chunk's, with return_token_ids

    omit_if_none = _ASKED_FOR


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
    token_strs: list[str] | None = None  # with return_token_strs: the tokenizer's string of each id


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
