"""The pooling routes (runner="pooling"): OpenAI's /v1/embeddings, and vLLM's /pooling, /classify,
/score (and /v1/score), /rerank (and /v1/rerank, /v2/rerank: Jina's and Cohere's shape).

/v1/embeddings, /pooling and /classify take `messages` (vLLM's chat-style input) instead of `input`:
rendered with the chat template as /tokenize renders them, tokenized, and pooled like a prompt of those ids.

Every input becomes one pooling request (AsyncLLM.encode); all are checked before any is added, and a
client that leaves aborts them. A server of the other runner refuses these routes (and a pooling
server refuses generation, in AsyncLLM.add_request) with a 400 naming the runner.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time

import numpy as np
from fastapi import FastAPI, Request, Response

from xlaserve.entrypoints.openai.pooling_protocol import (
    ChatInputFields,
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EncodingFields,
    PoolingData,
    PoolingRequest,
    PoolingRequestBase,
    PoolingResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from xlaserve.entrypoints.pooling_io import cosine, output_bytes, pair_token_ids, score_pairs
from xlaserve.entrypoints.serving.chat_template import apply_chat_template
from xlaserve.entrypoints.serving.engine_io import (
    engine_error,
    request_ids,
    require_tokenizer,
    tokenize_text,
    truncated,
)
from xlaserve.entrypoints.serving.errors import APIError, bad_request
from xlaserve.entrypoints.serving.multimodal import media_parts
from xlaserve.entrypoints.serving.protocol import ErrorResponse
from xlaserve.entrypoints.serving.state import ServerState, check_model
from xlaserve.pooling_params import PoolingParams

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 415, 503)}


def _require_pooling(state: ServerState, path: str) -> None:
    runner = state.engine.config.model.runner
    if runner != "pooling":
        raise bad_request(
            f"{path} needs a pooling model, and this server runs runner={runner!r} (start it with "
            "--runner pooling)",
            "model",
            code="wrong_runner",
        )


def _token_ids(
    state: ServerState,
    value,
    add_special_tokens: bool,
    field: str,
    keep: int | None = None,
    side: str | None = None,
) -> list[list[int]]:
    """The prompts of an `input`: a string, strings, token ids, or token id lists; each cut to `keep`
    tokens (truncate_prompt_tokens: its last, or its first where `side` is "right") and checked."""
    engine = state.engine
    if isinstance(value, str) or (value and isinstance(value[0], str)):
        texts = [value] if isinstance(value, str) else value
        prompts = []
        for i, text in enumerate(texts):
            where = field if isinstance(value, str) else f"{field}[{i}]"
            if not text:
                raise bad_request(f"{where} is empty", where)
            prompts.append(tokenize_text(engine, text, add_special_tokens, where))
    else:
        prompts = [value] if isinstance(value[0], int) else value
    prompts = [truncated(engine, ids, keep, side=side) for ids in prompts]
    for i, ids in enumerate(prompts):
        where = field if len(prompts) == 1 else f"{field}[{i}]"
        try:
            engine.input_processor.validate_prompt(ids)
            engine.input_processor.check_fits(len(ids), 1)
        except ValueError as e:
            raise bad_request(f"{where}: {e}", where) from None
    return prompts


_CHAT_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "chat_template")


def _input_prompts(state: ServerState, req: ChatInputFields) -> list[list[int]]:
    """The prompts of a request that sends `input` or `messages` (exactly one): a chat is rendered with
    the chat template (add_generation_prompt false by default, as vLLM's) and is one prompt."""
    if req.messages is None:
        if req.input is None:
            raise bad_request("'input' is a required property (or 'messages': a chat to embed)", "input")
        for field in _CHAT_FIELDS:
            if getattr(req, field) is not None:
                raise bad_request(f"{field} applies to messages; this request sends input", field)
        add_special_tokens = True if req.add_special_tokens is None else req.add_special_tokens
        return _token_ids(
            state, req.input, add_special_tokens, "input", req.truncate_prompt_tokens, req.truncation_side
        )
    if req.input is not None:
        raise bad_request("send input or messages, not both", "messages")
    media = media_parts(req.messages, ("image_url", "video_url"))
    if media:
        raise bad_request("the pooling routes take text messages only, not images or videos", media[0][0])
    text = apply_chat_template(
        state,
        req.messages,
        bool(req.add_generation_prompt),
        bool(req.continue_final_message),
        None,
        req.chat_template_kwargs,
        req.chat_template,
    )
    ids = tokenize_text(state.engine, text, bool(req.add_special_tokens), "messages")
    if not ids:
        raise bad_request("the messages render to an empty prompt (0 tokens)", "messages")
    return _token_ids(state, [ids], False, "messages", req.truncate_prompt_tokens, req.truncation_side)


def _check_params(state: ServerState, params: PoolingParams, task_field: str = "model") -> None:
    """A 400 naming the field unless the engine serves `params`: a task it does not serve names
    `task_field` (the request's `task` where it sent one, else the model)."""
    try:
        state.engine.input_processor.validate_pooling(params)
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        raise bad_request(str(e), task_field if field == "pooling_task" else field) from None


def _params(req: PoolingRequestBase, task: str, **fields) -> PoolingParams:
    """The request's PoolingParams for `task`: vLLM's `use_activation` is both an embed task's
    `normalize` and a classify task's `activation` (each task reads its own); those, where sent, win."""
    use = req.use_activation
    normalize, activation = getattr(req, "normalize", None), getattr(req, "activation", None)
    return PoolingParams(
        task=task,
        normalize=use if normalize is None else normalize,
        activation=use if activation is None else activation,
        **fields,
    )


async def _encode_all(
    state: ServerState,
    raw_request: Request,
    req: PoolingRequestBase,
    prompts,
    params: PoolingParams,
    engine_id: str,
) -> list:
    """The pooled output of each prompt, in order (the engine's ids `engine_id`-i, with the request's
    priority and cache_salt); a client that leaves aborts them all."""
    _check_params(state, params)
    tasks = [
        asyncio.create_task(
            state.engine.encode(
                ids, params, f"{engine_id}-{i}", priority=req.priority, cache_salt=req.cache_salt
            )
        )
        for i, ids in enumerate(prompts)
    ]
    work = asyncio.ensure_future(asyncio.gather(*tasks))
    disconnect = asyncio.create_task(_wait_for_disconnect(raw_request))
    try:
        await asyncio.wait({work, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            raise APIError(499, "client disconnected")
        return work.result()
    except APIError:
        raise
    except Exception as e:
        raise engine_error(e) from None
    finally:
        disconnect.cancel()
        for task in tasks:
            task.cancel()  # a request still running is aborted in the core (AsyncLLM.encode)


async def _wait_for_disconnect(raw_request: Request) -> None:
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


def _usage(prompts, usage_class: type[RerankUsage] = PoolingUsage) -> RerankUsage:
    num_tokens = sum(len(ids) for ids in prompts)
    return usage_class(prompt_tokens=num_tokens, total_tokens=num_tokens)


def _encoded(vector: np.ndarray, req: EncodingFields):
    if req.encoding_format == "base64":
        return base64.b64encode(output_bytes(vector, req.embed_dtype, req.endianness)).decode("ascii")
    return vector.tolist()


def _bytes_response(request_id: str, model: str, outputs: list, prompts, req: EncodingFields) -> Response:
    """vLLM's encoding_format "bytes": the outputs' bytes one after another, and a `metadata` header
    with the JSON answer's fields less the vectors: each output's byte range and shape in `data`."""
    chunks, items, start = [], [], 0
    for i, vector in enumerate(outputs):
        chunks.append(output_bytes(vector, req.embed_dtype, req.endianness))
        end = start + len(chunks[-1])
        items.append(
            {
                "index": i,
                "embed_dtype": req.embed_dtype,
                "endianness": req.endianness,
                "start": start,
                "end": end,
                "shape": list(vector.shape),
            }
        )
        start = end
    usage = _usage(prompts, RerankUsage).model_dump()
    metadata = {"id": request_id, "created": int(time.time()), "model": model, "data": items, "usage": usage}
    return Response(
        b"".join(chunks), media_type="application/octet-stream", headers={"metadata": json.dumps(metadata)}
    )


# /score's two sides under vLLM's names, and what each pairs with.
_SCORE_PAIRS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))
_SCORE_FIELDS = tuple(dict.fromkeys(name for pair in _SCORE_PAIRS for name in pair))


def _score_fields(req: ScoreRequest) -> tuple[str, str]:
    """The pair of /score's fields the request sent (one pair, both sides), else a 400 naming the field
    missing or the one that does not pair."""
    sent = [name for name in _SCORE_FIELDS if getattr(req, name) is not None]
    for pair in _SCORE_PAIRS:
        if set(sent) == set(pair):
            return pair
    if not sent:
        raise bad_request(
            "'text_1' and 'text_2' are required (or vLLM's queries with documents or items, or data_1 "
            "with data_2)",
            "text_1",
        )
    if len(sent) == 1:
        partner = next(b if a == sent[0] else a for a, b in _SCORE_PAIRS if sent[0] in (a, b))
        raise bad_request(f"{partner} is required with {sent[0]}", partner)
    # A whole pair and more, or two halves of different pairs: the field past the first pair is named.
    first = next((pair for pair in _SCORE_PAIRS if set(pair) <= set(sent)), sent[:1])
    extra = next(name for name in sent if name not in first)
    pairs = ", ".join(f"{a} with {b}" for a, b in _SCORE_PAIRS)
    raise bad_request(f"{extra} does not pair with {' and '.join(first)}: send one of {pairs}", extra)


async def _scores(
    state: ServerState,
    raw_request: Request,
    req: ScoreRequest | RerankRequest,
    pairs: list[tuple],
    fields: tuple[str, str],
    path: str,
    engine_id: str,
) -> tuple[list, list]:
    """(a score per pair, the prompts run): a classifier's probability of the joined pair (a
    cross-encoder), or the cosine of two embeddings; each prompt (a joined pair, or one text) cut to
    truncate_prompt_tokens tokens on its truncation_side, as vLLM's. `fields`: the request's names of
    the pairs' sides, which errors name."""
    engine, keep, side = state.engine, req.truncate_prompt_tokens, req.truncation_side
    if engine.pooling_task == "classify":
        tokenizer = require_tokenizer(engine, path, None)
        prompts = [pair_token_ids(tokenizer, a, b) for a, b in pairs]
        prompts = _token_ids(state, prompts, True, fields[1], keep, side)
        outputs = await _encode_all(state, raw_request, req, prompts, _params(req, "score"), engine_id)
        if outputs and outputs[0].size != 1:
            raise bad_request(
                f"{path} needs a classifier with one label; this one has {outputs[0].size}", "model"
            )
        return [float(o.reshape(-1)[0]) for o in outputs], prompts
    # Each text embedded once, an error naming the side it came from.
    firsts = list(dict.fromkeys(a for a, _ in pairs))
    seconds = [t for t in dict.fromkeys(b for _, b in pairs) if t not in firsts]
    texts = firsts + seconds
    prompts = _token_ids(state, firsts, True, fields[0], keep, side)
    prompts += _token_ids(state, seconds, True, fields[1], keep, side) if seconds else []
    outputs = await _encode_all(state, raw_request, req, prompts, PoolingParams(task="embed"), engine_id)
    by_text = dict(zip(texts, outputs))
    return [cosine(by_text[a], by_text[b]) for a, b in pairs], prompts


def add_pooling_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/embeddings", responses=_ERRORS)
    async def embeddings(req: EmbeddingRequest, raw_request: Request) -> EmbeddingResponse:
        _require_pooling(state, "/v1/embeddings")
        model = check_model(state, req.model)
        prompts = _input_prompts(state, req)
        params = _params(req, "embed", dimensions=req.dimensions)
        request_id, engine_id = request_ids(raw_request, "embd")
        outputs = await _encode_all(state, raw_request, req, prompts, params, engine_id)
        if req.encoding_format == "bytes":
            return _bytes_response(request_id, model, outputs, prompts, req)
        data = [EmbeddingData(index=i, embedding=_encoded(v, req)) for i, v in enumerate(outputs)]
        return EmbeddingResponse(id=request_id, model=model, data=data, usage=_usage(prompts))

    @app.post("/pooling", responses=_ERRORS)
    async def pooling(req: PoolingRequest, raw_request: Request) -> PoolingResponse:
        _require_pooling(state, "/pooling")
        model = check_model(state, req.model)
        prompts = _input_prompts(state, req)
        task = req.task or ("reward" if state.engine.pooling_task == "reward" else "encode")
        params = _params(req, task, dimensions=req.dimensions)
        _check_params(state, params, "task")
        request_id, engine_id = request_ids(raw_request, "pool")
        outputs = await _encode_all(state, raw_request, req, prompts, params, engine_id)
        if req.encoding_format == "bytes":
            return _bytes_response(request_id, model, outputs, prompts, req)
        data = [PoolingData(index=i, data=_encoded(v, req)) for i, v in enumerate(outputs)]
        return PoolingResponse(id=request_id, model=model, data=data, usage=_usage(prompts))

    @app.post("/classify", responses=_ERRORS)
    async def classify(req: ClassificationRequest, raw_request: Request) -> ClassificationResponse:
        _require_pooling(state, "/classify")
        model = check_model(state, req.model)
        prompts = _input_prompts(state, req)
        request_id, engine_id = request_ids(raw_request, "classify")
        outputs = await _encode_all(state, raw_request, req, prompts, _params(req, "classify"), engine_id)
        labels = state.engine.id2label  # config.json's id2label, by index
        data = [
            ClassificationData(
                index=i,
                label=labels[k] if (k := int(np.argmax(v))) < len(labels) else f"LABEL_{k}",
                probs=v.tolist(),
                num_classes=v.size,
            )
            for i, v in enumerate(outputs)
        ]
        return ClassificationResponse(id=request_id, model=model, data=data, usage=_usage(prompts))

    async def score(req: ScoreRequest, raw_request: Request) -> ScoreResponse:
        _require_pooling(state, "/score")
        model = check_model(state, req.model)
        fields = _score_fields(req)
        try:
            pairs = score_pairs(*(getattr(req, name) for name in fields), *fields)
        except ValueError as e:
            raise bad_request(str(e), str(e).split(" ", 1)[0]) from None
        request_id, engine_id = request_ids(raw_request, "score")
        scores, prompts = await _scores(state, raw_request, req, pairs, fields, "/score", engine_id)
        data = [ScoreData(index=i, score=s) for i, s in enumerate(scores)]
        return ScoreResponse(id=request_id, model=model, data=data, usage=_usage(prompts))

    async def rerank(req: RerankRequest, raw_request: Request) -> RerankResponse:
        _require_pooling(state, "/rerank")
        model = check_model(state, req.model)
        request_id, engine_id = request_ids(raw_request, "rerank")
        documents = [req.documents] if isinstance(req.documents, str) else req.documents
        pairs = [(req.query, d) for d in documents]
        fields = ("query", "documents")
        scores, prompts = await _scores(state, raw_request, req, pairs, fields, "/rerank", engine_id)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if req.top_n:
            order = order[: req.top_n]
        results = [
            RerankResult(
                index=i,
                relevance_score=scores[i],
                document=RerankDocument(text=documents[i]) if req.return_documents else None,
            )
            for i in order
        ]
        usage = _usage(prompts, RerankUsage)
        return RerankResponse(id=request_id, model=model, usage=usage, results=results)

    for path in ("/score", "/v1/score"):
        app.post(path, responses=_ERRORS)(score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path, responses=_ERRORS)(rerank)
