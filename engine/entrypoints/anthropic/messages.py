"""POST /v1/messages and /v1/messages/count_tokens: an Anthropic request through the chat path (the
chat template, SamplingParams, structured outputs for a forced tool), answered as a message or as
Anthropic's event stream. Errors come out in Anthropic's shape (errors.py picks it by the path)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from xlaserve.entrypoints.anthropic.convert import render, sampling_params, to_chat
from xlaserve.entrypoints.anthropic.output import blocks_of, stop_reason
from xlaserve.entrypoints.anthropic.protocol import (
    AnthropicErrorResponse,
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
    MessagesResponse,
    ToolUseBlock,
    Usage,
)
from xlaserve.entrypoints.anthropic.reading import make_reader
from xlaserve.entrypoints.anthropic.streaming import event_stream
from xlaserve.entrypoints.openai.serving import (
    ServerState,
    check_context,
    check_finish,
    check_model,
    collect_final,
    engine_error,
    new_id,
    tokenize_text,
)

logger = logging.getLogger("xlaserve.entrypoints.anthropic")


def _errors(*codes: int) -> dict:
    return {code: {"model": AnthropicErrorResponse} for code in codes}


def add_routes(app: FastAPI, state: ServerState) -> None:
    @app.post(
        "/v1/messages",
        response_model=None,
        responses={
            200: {
                "model": MessagesResponse,
                "content": {"text/event-stream": {"schema": {"type": "string"}}},
            },
            **_errors(400, 401, 404, 413, 415, 503),
        },
    )
    async def messages(request: MessagesRequest, raw_request: Request):
        return await create_message(state, request, raw_request)

    @app.post("/v1/messages/count_tokens", responses=_errors(400, 401, 404, 413, 415))
    async def count_tokens(request: CountTokensRequest) -> CountTokensResponse:
        check_model(state, request.model)
        ids = _prompt_ids(state, request)[1]
        return CountTokensResponse(input_tokens=len(ids))


def _prompt_ids(state: ServerState, req: CountTokensRequest) -> tuple[str, list[int]]:
    text = render(state, to_chat(req))
    return text, tokenize_text(state.engine, text, False, "messages")


async def create_message(state: ServerState, req: MessagesRequest, raw_request: Request):
    model = check_model(state, req.model)
    text, ids = _prompt_ids(state, req)
    check_context(state.engine, len(ids), req.max_tokens, "messages")
    reader = make_reader(state, req)
    params = sampling_params(req, reader.constraint)
    request_id = new_id("msg").replace("-", "_")
    try:
        stream = state.engine.add_request(
            ids, params, request_id, prompt=text, output_kind="delta" if req.stream else "final"
        )
    except Exception as e:  # noqa: BLE001 - every failure becomes an API error
        raise engine_error(e) from None
    if state.log_requests:
        logger.info("request %s: %d prompt tokens, %s", request_id, len(ids), params)
    if req.stream:
        return StreamingResponse(
            event_stream(request_id, model, stream, len(ids), reader), media_type="text/event-stream"
        )
    try:
        (output,) = await collect_final(raw_request, [stream])
    except Exception as e:  # noqa: BLE001 - every failure becomes an API error
        raise engine_error(e) from None
    check_finish(output)
    (completion,) = output.outputs
    blocks = blocks_of([*reader.feed(completion.text), *reader.flush()])
    reason, sequence = stop_reason(completion, any(isinstance(b, ToolUseBlock) for b in blocks))
    return MessagesResponse(
        id=request_id,
        content=blocks,
        model=model,
        stop_reason=reason,
        stop_sequence=sequence,
        usage=Usage(input_tokens=len(ids), output_tokens=len(completion.token_ids)),
    )
