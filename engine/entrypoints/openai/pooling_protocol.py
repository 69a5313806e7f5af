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
    truncation_side: Literal["left", "right"] | None = Field(
        default=None,
        description="truncate_prompt_tokens keeps the last N tokens (left, the default), or the first N",
    )
    cache_salt: Text | None = Field(
        default=None,
        min_length=1,
        max_length=1024,
        description="isolates prefix-cache sharing: requests only share cached blocks with equal salts",
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


class EncodingFields(StrictModel):
    """How vectors are sent (vLLM's): `float` (JSON numbers), `base64` (their bytes in `embed_dtype` and
    `endianness`), or `bytes`: the body is every output's bytes one after another, and its `metadata`
    header the JSON of the response less the vectors, each output's byte range and shape in `data`."""

    encoding_format: Literal["float", "base64", "bytes"] = "float"
    embed_dtype: Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"] = "float32"
    endianness: Literal["native", "big", "little"] = "native"


class EmbeddingRequest(EncodingFields, ChatInputFields, PoolingRequestBase):
    dimensions: Dimensions | None = None
    normalize: bool | None = None  # vLLM's extra


class PoolingRequest(EncodingFields, ChatInputFields, PoolingRequestBase):
    """vLLM's /pooling: `task` (None: the model's own output, `reward` for a reward model, else
    `encode`: the pooled hidden states), and the embed and classify tasks' settings. A token task's
    output has one row per prompt token (base64: the rows' values one after another)."""

    task: Literal["embed", "classify", "encode", "reward", "token_embed", "token_classify"] | None = None
    dimensions: Dimensions | None = None
    normalize: bool | None = None
    activation: bool | None = None


class ClassificationRequest(ChatInputFields, PoolingRequestBase):
    pass


ScoreSide = Text | TextList


class ScoreRequest(PoolingRequestBase):
    """The two sides of /score under any of vLLM's names: `queries` with `documents` or `items`,
    `data_1` with `data_2`, or `text_1` with `text_2` (the route checks that one pair is sent)."""

    queries: ScoreSide | None = None
    documents: ScoreSide | None = None
    items: ScoreSide | None = None
    data_1: ScoreSide | None = None
    data_2: ScoreSide | None = None
    text_1: ScoreSide | None = None
    text_2: ScoreSide | None = None


class RerankRequest(PoolingRequestBase):
    query: Text
    documents: ScoreSide  # one document too, as vLLM's
    top_n: Annotated[int, Field(ge=0)] | None = None  # None or 0: every document
    return_documents: bool = True


class RerankUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class PoolingUsage(RerankUsage):
    """vLLM's UsageInfo, as its pooling routes send it (rerank's has only the two counts)."""

    completion_tokens: int = 0
    prompt_tokens_details: None = None


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
    embedding: list[float] | str  # base64: the bytes in the request's embed_dtype and endianness


class EmbeddingResponse(PoolingList):
    data: list[EmbeddingData]


class PoolingData(BaseModel):
    object: Literal["pooling"] = "pooling"
    index: int
    data: Any  # a vector or, ALL pooling, one row per token; base64: their bytes, as EmbeddingData's


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
    usage: RerankUsage
    results: list[RerankResult]
