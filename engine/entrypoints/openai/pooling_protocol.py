"""The pooling routes' request and response shapes (pydantic): OpenAI's /v1/embeddings, and vLLM's
/pooling, /classify, /score and /rerank (Jina's and Cohere's shape).

/v1/embeddings, /pooling and /classify take vLLM's chat-style input too: `messages` instead of `input`,
rendered with the chat template (vLLM's EmbeddingChatRequest and ClassificationChatRequest; one request
model holds both, and the route checks that exactly one is sent)."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from xlaserve.entrypoints.serving.chat_protocol import ChatMessage
from xlaserve.entrypoints.serving.protocol import (
    CHAT_TEMPLATE_HELP,
    ChatTemplate,
    JsonObject,
    StrictModel,
    Text,
    TokenId,
    TruncatePromptTokens,
)

MAX_INPUTS = 256  # prompts per request: each is a sequence in the batch
MAX_MESSAGES = 1024  # a chat's messages: rendered into one prompt, which max_model_len bounds anyway

TextList = Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
IdsList = Annotated[
    list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_INPUTS)
]
# A string, a list of strings, token ids, or a list of token id lists (OpenAI's embeddings input).
PoolingInput = Text | TextList | Annotated[list[TokenId], Field(min_length=1)] | IdsList
Dimensions = Annotated[int, Field(ge=1)]


class PoolingRequestBase(StrictModel):
    model: Text | None = None
    user: Text | None = None
    priority: int = 0
    add_special_tokens: bool = True
    truncate_prompt_tokens: TruncatePromptTokens | None = Field(
        default=None, description="keep each prompt's last N tokens (-1: the context's length)"
    )
    # vLLM's: an embed task's normalization, a classify or score task's sigmoid/softmax (None: on).
    use_activation: bool | None = None


class ChatInputFields(StrictModel):
    """`input`, or vLLM's chat-style input: `messages` rendered with the chat template, then embedded
    like a prompt. The chat fields' None is vLLM's default (false), and is not sent with `input`;
    add_special_tokens' None is true for `input`, false for `messages` (the template adds its own)."""

    input: PoolingInput | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: JsonObject | None = None
    chat_template: ChatTemplate | None = Field(default=None, description=CHAT_TEMPLATE_HELP)
    add_special_tokens: bool | None = None


class EmbeddingRequest(ChatInputFields, PoolingRequestBase):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Dimensions | None = None
    normalize: bool | None = None  # vLLM's extra


class PoolingRequest(ChatInputFields, PoolingRequestBase):
    """vLLM's /pooling: `task` (None: the model's own output, `reward` for a reward model, else
    `encode`: the pooled hidden states), and the embed and classify tasks' settings. A token task's
    output has one row per prompt token (base64: the rows' floats one after another)."""

    encoding_format: Literal["float", "base64"] = "float"
    task: Literal["embed", "classify", "encode", "reward", "token_embed", "token_classify"] | None = None
    dimensions: Dimensions | None = None
    normalize: bool | None = None
    activation: bool | None = None


class ClassificationRequest(ChatInputFields, PoolingRequestBase):
    pass


class ScoreRequest(PoolingRequestBase):
    text_1: Text | TextList
    text_2: Text | TextList


class RerankRequest(PoolingRequestBase):
    query: Text
    documents: TextList
    top_n: Annotated[int, Field(ge=0)] | None = None  # None or 0: every document
    return_documents: bool = True


class PoolingUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class PoolingList(BaseModel):
    """What every pooling route's answer shares: a list object (`data` in each subclass) and its usage."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: PoolingUsage


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: the float32 little-endian bytes


class EmbeddingResponse(PoolingList):
    data: list[EmbeddingData]


class PoolingData(BaseModel):
    object: Literal["pooling"] = "pooling"
    index: int
    data: Any  # a vector or, ALL pooling, one row per token; base64: the float32 bytes


class PoolingResponse(PoolingList):
    data: list[PoolingData]


class ClassificationData(BaseModel):
    object: Literal["classification"] = "classification"
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassificationResponse(PoolingList):
    data: list[ClassificationData]


class ScoreData(BaseModel):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(PoolingList):
    data: list[ScoreData]


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: PoolingUsage
    results: list[RerankResult]
