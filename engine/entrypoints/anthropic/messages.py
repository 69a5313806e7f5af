"""POST /v1/messages and /v1/messages/count_tokens: an Anthropic request through the shared chat path
(serving/: the chat template, SamplingParams, structured outputs for a forced tool), answered as a
message or as Anthropic's event stream. Errors come out in Anthropic's shape (serving/errors.py picks
it by the path)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from xlaserve.entrypoints.anthropic.convert import to_chat_request
from xlaserve.entrypoints.anthropic.mcp import count_with_mcp, create_with_mcp
from xlaserve.entrypoints.anthropic.output import PREWARMED, stop_reason
from xlaserve.entrypoints.anthropic.prompt import render
from xlaserve.entrypoints.anthropic.protocol import (
    AnthropicErrorResponse,
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
    MessagesResponse,
    ToolUseBlock,
    Usage,
)
from xlaserve.entrypoints.anthropic.reading import ChoiceReader
from xlaserve.entrypoints.anthropic.streaming import event_stream
from xlaserve.entrypoints.serving.chat_path import chat_sampling_params, choice_parser
from xlaserve.entrypoints.serving.engine_io import (
    check_context,
    check_finish,
    collect_final,
    engine_error,
    new_id,
    submit,
)
from xlaserve.entrypoints.serving.errors import bad_request
from xlaserve.entrypoints.serving.protocol import sse_or_json
from xlaserve.entrypoints.serving.state import ServerState, check_model

logger = logging.getLogger("xlaserve.entrypoints.anthropic")


def _errors(*codes: int) -> dict:
    return {code: {"model": AnthropicErrorResponse} for code in codes}


def add_routes(app: FastAPI, state: ServerState) -> None:
    @app.post(
        "/v1/messages",
        response_model=None,
        responses={
            **sse_or_json(MessagesResponse),
            **_errors(400, 401, 404, 413, 415, 424, 503),
        },
    )
    async def messages(request: MessagesRequest, raw_request: Request):
        return await create_message(state, request, raw_request)

    @app.post("/v1/messages/count_tokens", responses=_errors(400, 401, 404, 413, 415, 424))
    async def count_tokens(request: CountTokensRequest) -> CountTokensResponse:
        check_model(state, request.model)
        if request.mcp_servers:  # the servers listed and their tools offered, as /v1/messages does
            return CountTokensResponse(input_tokens=await count_with_mcp(state, request))
        ids = (await render(state, request, to_chat_request(request)))[3]
        return CountTokensResponse(input_tokens=len(ids))


async def create_message(state: ServerState, req: MessagesRequest, raw_request: Request):
    model = check_model(state, req.model)
    if req.mcp_servers:
        if req.kv_transfer_params is not None:  # one prompt's blocks; an MCP message runs several turns
            raise bad_request("kv_transfer_params cannot be combined with mcp_servers", "kv_transfer_params")
        if req.max_tokens == 0:  # which turns' prompts would it warm? Only the first is known up front
            raise bad_request(
                "max_tokens: 0 (cache pre-warming) cannot be combined with mcp_servers", "max_tokens"
            )
        return await create_with_mcp(state, req, raw_request, model)
    chat, plan, text, ids, mm_features = await render(state, req, to_chat_request(req))
    check_context(state.engine, len(ids), req.max_tokens, "messages")
    params = chat_sampling_params(state, chat, plan, ids, chat.max_tokens)
    reader = ChoiceReader(choice_parser(state, chat, plan, ids))
    request_id = new_id("msg").replace("-", "_")
    kwargs = {"prompt": text, "mm_features": mm_features, "cache_salt": chat.cache_salt}
    stream = submit(state, ids, params, request_id, stream=req.stream, **kwargs)
    is_prewarm = req.max_tokens == 0
    if req.stream:
        return StreamingResponse(
            event_stream(
                request_id,
                model,
                stream,
                len(ids),
                reader,
                with_details=state.enable_prompt_tokens_details,
                is_prewarm=is_prewarm,
            ),
            media_type="text/event-stream",
        )
    try:
        (output,) = await collect_final(raw_request, [stream])
    except Exception as e:  # noqa: BLE001 - every failure becomes an API error
        raise engine_error(e) from None
    check_finish(output)
    (completion,) = output.outputs
    if is_prewarm:  # the prompt is cached; its one sampled token (convert.py) is no answer
        blocks, (reason, sequence), num_generated = [], PREWARMED, 0
    else:
        blocks = reader.blocks(completion.text)
        reason, sequence = stop_reason(completion, any(isinstance(b, ToolUseBlock) for b in blocks))
        num_generated = len(completion.token_ids)
    usage = Usage.of(len(ids), num_generated, output, state.enable_prompt_tokens_details)
    return MessagesResponse(
        id=request_id,
        content=blocks,
        model=model,
        stop_reason=reason,
        stop_sequence=sequence,
        usage=usage,
        kv_transfer_params=output.kv_transfer_params,
    )
