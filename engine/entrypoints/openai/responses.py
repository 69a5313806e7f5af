"""OpenAI's Responses API, as vLLM serves it: POST /v1/responses (streamed as typed events or not),
GET and DELETE /v1/responses/{id}.

A request takes the chat path (responses_convert.py: the chat template, the tool plan, SamplingParams
with structured outputs, the ChoiceParser's reasoning and tool parsers); its parse becomes output items
(reasoning, message, function_call). With `store` (the default) the response and its conversation
are kept in a bounded LRU (responses_store.py), which `previous_response_id` continues and the GET
and DELETE routes read.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi import Response as HTTPResponse
from fastapi.responses import StreamingResponse

from xlaserve.entrypoints.openai.mcp_tools import mcp_tools_of
from xlaserve.entrypoints.openai.responses_background import UNFINISHED, BackgroundResponses, check_background
from xlaserve.entrypoints.openai.responses_convert import input_turns, media_fields
from xlaserve.entrypoints.openai.responses_mcp import create_with_mcp
from xlaserve.entrypoints.openai.responses_output import DeletedResponse, Response
from xlaserve.entrypoints.openai.responses_protocol import McpTool, ResponsesRequest
from xlaserve.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from xlaserve.entrypoints.openai.responses_stream import EventWriter, OutputStream
from xlaserve.entrypoints.openai.responses_turn import (
    Saver,
    Totals,
    cut_calls,
    end_event,
    finished,
    prepare_turn,
    reply,
    response_ids,
    response_shell,
    stream_turn,
)
from xlaserve.entrypoints.serving.chat_parsing import ChoiceParser
from xlaserve.entrypoints.serving.chat_path import choice_parser
from xlaserve.entrypoints.serving.engine_io import check_num_logprobs, submit
from xlaserve.entrypoints.serving.errors import APIError, bad_request
from xlaserve.entrypoints.serving.protocol import ErrorResponse, sse_or_json
from xlaserve.entrypoints.serving.state import ServerState, check_model


def _errors(*codes: int) -> dict:
    return {code: {"model": ErrorResponse} for code in codes}


def add_responses_routes(app: FastAPI, state: ServerState) -> None:
    store = ResponseStore(state.max_stored_responses)
    background = BackgroundResponses(store)

    @app.post(
        "/v1/responses",
        response_model=None,
        responses={
            **sse_or_json(Response),
            **_errors(400, 401, 404, 413, 415, 503),
        },
    )
    async def create(request: ResponsesRequest, raw_request: Request, http_response: HTTPResponse):
        answer = await create_response(state, store, request, raw_request, background)
        # The response's id is the store's key, never a client's: the client's id comes back as a header.
        sent = raw_request.headers.get("x-request-id") or request.request_id
        if sent is not None:
            (answer if isinstance(answer, HTTPResponse) else http_response).headers["X-Request-Id"] = sent
        return answer

    @app.get(
        "/v1/responses/{response_id}",
        response_model=None,
        responses={
            **sse_or_json(Response),
            **_errors(400, 401, 404),
        },
    )
    async def retrieve(response_id: str, stream: bool = False, starting_after: int = -1):
        """The stored response; `stream`: a background response's events after `starting_after`."""
        stored = Response.model_validate(_stored(store, response_id, "response_id").response)
        if not stream:
            return stored
        return StreamingResponse(
            background.follow(response_id, starting_after), media_type="text/event-stream"
        )

    @app.post("/v1/responses/{response_id}/cancel", responses=_errors(400, 401, 404))
    async def cancel(response_id: str) -> Response:
        """Stop a background response: `cancelled` (one already finished is returned as it is)."""
        stored = Response.model_validate(_stored(store, response_id, "response_id").response)
        if not stored.background:
            raise bad_request("only a background response can be cancelled", "response_id")
        await background.cancel(response_id)
        return Response.model_validate(_stored(store, response_id, "response_id").response)

    @app.delete("/v1/responses/{response_id}", responses=_errors(401, 404))
    async def delete(response_id: str) -> DeletedResponse:
        _stored(store, response_id, "response_id")
        await background.cancel(response_id)  # a background response still running stops
        store.delete(response_id)
        return DeletedResponse(id=response_id)


def _stored(store: ResponseStore, response_id: str, param: str) -> StoredResponse:
    entry = store.get(response_id)
    shown = response_id if len(response_id) <= 64 else response_id[:64] + "..."
    if entry is None:
        raise APIError(404, f"Response with id '{shown}' not found.", param=param, code="response_not_found")
    return entry


def _continued(store: ResponseStore, response_id: str) -> StoredResponse:
    """The stored response `previous_response_id` names: one with an answer to continue from."""
    entry = _stored(store, response_id, "previous_response_id")
    shown = response_id if len(response_id) <= 64 else response_id[:64] + "..."
    if entry.response["status"] in UNFINISHED + ("cancelled", "failed"):
        raise bad_request(
            f"response {shown!r} is {entry.response['status']}: it has no answer to continue",
            "previous_response_id",
        )
    return entry


async def create_response(
    state: ServerState,
    store: ResponseStore,
    req: ResponsesRequest,
    raw_request: Request,
    background: BackgroundResponses,
):
    model = check_model(state, req.model)
    check_num_logprobs(state.engine, top_logprobs=req.top_logprobs)
    response_id, engine_id = response_ids(raw_request, req)
    if req.background:
        check_background(req, store)
    history: list[dict] = []
    cut: set[str] = set()
    if req.previous_response_id is not None:
        previous = _continued(store, req.previous_response_id)
        history, cut = previous.conversation, cut_calls(previous.response)
    conversation = history + input_turns(req, history, cut)
    fields = media_fields(req, history)
    if req.kv_transfer_params is not None and any(isinstance(tool, McpTool) for tool in req.tools or ()):
        # One prompt's blocks; an MCP response runs several model turns.
        raise bad_request("kv_transfer_params cannot be combined with mcp tools", "kv_transfer_params")
    mcp_tools = mcp_tools_of(req, state.tool_servers)
    if mcp_tools:
        return await create_with_mcp(
            state, store, req, raw_request, model, conversation, fields, mcp_tools, background,
            (response_id, engine_id),
        )  # fmt: skip
    chat, plan, text, ids, params, mm_features = await prepare_turn(state, req, conversation, fields)
    shell = response_shell(req, plan, response_id, model)

    def start():
        return submit(
            state,
            ids,
            params,
            engine_id,
            stream=True,
            prompt=text,
            priority=chat.priority,
            cache_salt=chat.cache_salt,
            lora_request=state.lora_request(req.model),
            mm_features=mm_features,
        )

    parser = choice_parser(state, chat, plan, ids)
    saved = Saver(store, req.store, conversation)
    run = _OneTurn(state, shell, start, len(ids), parser, params.logprobs, saved, req.include_reasoning)
    return await reply(run, req, raw_request, background, shell, conversation)


class _OneTurn:
    """A response of one model turn (no MCP tools): its events, streamed or drained for the whole answer
    (`response` once they have ended, stored by `saved`)."""

    def __init__(
        self,
        state,
        shell: Response,
        start,
        num_prompt_tokens: int,
        parser: ChoiceParser,
        top_n,
        saved,
        include_reasoning: bool,
    ):
        self.state, self.shell, self.start = state, shell, start
        self.num_prompt_tokens, self.parser, self.top_n, self.saved = num_prompt_tokens, parser, top_n, saved
        self.include_reasoning = include_reasoning
        self.write = EventWriter()
        self.response: Response | None = None

    async def events(self):
        write, shell = self.write, self.shell
        items = OutputStream(write, include_reasoning=self.include_reasoning)
        stream = self.start()  # before the first event: a refusal (a full queue) is still an HTTP error
        try:
            yield write("response.created", response=shell.model_dump())
            yield write("response.in_progress", response=shell.model_dump())
        except BaseException:  # closed before its turn was read (the client left): the request aborted
            stream.close()
            raise
        totals = Totals()
        totals.num_prompt = self.num_prompt_tokens
        async for event in stream_turn(self.state, stream, self.parser, items, totals, self.top_n):
            yield event
        for event in items.finish(totals.status):
            yield event
        self.response = finished(self.state, shell, items.items, totals)
        self.saved(self.response)
        yield end_event(write, self.response)
