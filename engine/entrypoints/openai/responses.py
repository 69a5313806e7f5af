"""OpenAI's Responses API, as vLLM serves it: POST /v1/responses (streamed as typed events or not),
GET and DELETE /v1/responses/{id}.

A request takes the chat path (responses_convert.py: the chat template, the tool plan, SamplingParams
with structured outputs, the ChoiceParser's reasoning and tool parsers); its parse becomes output items
(reasoning, message, function_call). With `store` (the default) the response and its conversation
are kept in a bounded LRU (responses_store.py), which `previous_response_id` continues and the GET
and DELETE routes read.
"""

from __future__ import annotations

import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from xlaserve.entrypoints.openai.mcp_tools import (
    MAX_MCP_ROUNDS,
    McpSession,
    mcp_tools_of,
    request_function_names,
)
from xlaserve.entrypoints.openai.responses_background import UNFINISHED, BackgroundResponses, check_background
from xlaserve.entrypoints.openai.responses_convert import (
    APPROVAL,
    image_fields,
    input_turns,
    rename_error,
    to_chat_request,
)
from xlaserve.entrypoints.openai.responses_output import (
    DeletedResponse,
    FunctionCallOutput,
    IncompleteDetails,
    InputTokensDetails,
    McpApprovalRequestOutput,
    McpCallOutput,
    OutputMessage,
    OutputTextPart,
    OutputTokensDetails,
    ReasoningOutput,
    ReasoningTextPart,
    Response,
    ResponseUsage,
)
from xlaserve.entrypoints.openai.responses_protocol import MCP_SECRETS, ResponsesRequest
from xlaserve.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from xlaserve.entrypoints.openai.responses_stream import EventWriter, OutputStream, item_id
from xlaserve.entrypoints.serving.chat_parsing import ChoiceParser, ParsedChoice
from xlaserve.entrypoints.serving.chat_path import chat_sampling_params, choice_parser
from xlaserve.entrypoints.serving.chat_template import apply_chat_template
from xlaserve.entrypoints.serving.engine_io import (
    check_context,
    check_finish,
    collect_final,
    engine_error,
    merge_streams,
    run_ahead,
    submit,
    tokenize_text,
    until_disconnect,
)
from xlaserve.entrypoints.serving.errors import APIError, bad_request
from xlaserve.entrypoints.serving.multimodal import (
    check_image_parts,
    image_parts,
    load_images,
    process_images,
)
from xlaserve.entrypoints.serving.protocol import ErrorResponse
from xlaserve.entrypoints.serving.state import ServerState, check_model
from xlaserve.entrypoints.serving.tools import ToolPlan, plan_tools

logger = logging.getLogger("xlaserve.entrypoints.openai")


def _errors(*codes: int) -> dict:
    return {code: {"model": ErrorResponse} for code in codes}


def add_responses_routes(app: FastAPI, state: ServerState) -> None:
    store = ResponseStore(state.max_stored_responses)
    background = BackgroundResponses(store)

    @app.post(
        "/v1/responses",
        response_model=None,
        responses={
            200: {"model": Response, "content": {"text/event-stream": {"schema": {"type": "string"}}}},
            **_errors(400, 401, 404, 413, 415, 503),
        },
    )
    async def create(request: ResponsesRequest, raw_request: Request):
        return await create_response(state, store, request, raw_request, background)

    @app.get(
        "/v1/responses/{response_id}",
        response_model=None,
        responses={
            200: {"model": Response, "content": {"text/event-stream": {"schema": {"type": "string"}}}},
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


def _usage(
    state: ServerState, num_prompt: int, num_generated: int, num_cached: int, reasoning: str
) -> ResponseUsage:
    tokenizer = state.engine.tokenizer
    num_reasoning = len(tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
    return ResponseUsage(
        input_tokens=num_prompt,
        input_tokens_details=InputTokensDetails(cached_tokens=num_cached),
        output_tokens=num_generated,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=min(num_reasoning, num_generated)),
        total_tokens=num_prompt + num_generated,
    )


def _shell(req: ResponsesRequest, plan: ToolPlan, request_id: str, model: str) -> Response:
    """The response as it stands before any output: what the request asked for, in progress."""
    if plan.choice == "named":
        tool_choice = {"type": "function", "name": plan.function_name}
    else:
        tool_choice = plan.choice
    text_format = req.text.format if req.text is not None and req.text.format is not None else None
    return Response(
        id=request_id,
        created_at=int(time.time()),
        status="in_progress",
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        model=model,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        previous_response_id=req.previous_response_id,
        reasoning={
            "effort": req.reasoning.effort if req.reasoning else None,
            "summary": req.reasoning.summary if req.reasoning else None,
        },
        store=req.store,
        temperature=1.0 if req.temperature is None else req.temperature,
        text={
            "format": text_format.model_dump(by_alias=True, exclude_none=True)
            if text_format
            else {"type": "text"}
        },
        tool_choice=tool_choice,
        tools=[tool.model_dump(exclude_none=True, exclude=MCP_SECRETS) for tool in req.tools or []],
        top_p=1.0 if req.top_p is None else req.top_p,
        user=req.user,
        metadata=req.metadata or {},
        background=bool(req.background),
    )


def _finished(response: Response, items, usage: ResponseUsage, finish_reason: str | None) -> Response:
    is_cut = finish_reason == "length"
    return response.model_copy(
        update={
            "status": "incomplete" if is_cut else "completed",
            "incomplete_details": IncompleteDetails(reason="max_output_tokens") if is_cut else None,
            "output": items,
            "usage": usage,
        }
    )


def output_items(parsed: ParsedChoice, status: str) -> list:
    """A whole answer's items: its reasoning, its text (an empty message when there is nothing else),
    then each call."""
    items = []
    if parsed.reasoning:
        items.append(ReasoningOutput(id=item_id("rs"), content=[ReasoningTextPart(text=parsed.reasoning)]))
    calls = [
        FunctionCallOutput(
            id=item_id("fc"), call_id=c.id, name=c.function.name, arguments=c.function.arguments
        )
        for c in parsed.tool_calls
    ]
    if parsed.content or not calls:
        items.append(
            OutputMessage(
                id=item_id("msg"), status=status, content=[OutputTextPart(text=parsed.content or "")]
            )
        )
    return items + calls


def answer_turn(items) -> dict:
    """The response's output as the assistant's chat turn, for a later request to continue."""
    text = "".join(p.text for item in items if isinstance(item, OutputMessage) for p in item.content)
    turn: dict = {"role": "assistant", "content": text}
    calls = [
        {"id": i.call_id, "type": "function", "function": {"name": i.name, "arguments": i.arguments}}
        for i in items
        if isinstance(i, FunctionCallOutput) and _is_object(i.arguments)
    ]
    if calls:
        turn["tool_calls"] = calls
    return turn


def _is_object(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


async def create_response(
    state: ServerState,
    store: ResponseStore,
    req: ResponsesRequest,
    raw_request: Request,
    background: BackgroundResponses,
):
    model = check_model(state, req.model)
    if req.background:
        check_background(req, store)
    history: list[dict] = []
    if req.previous_response_id is not None:
        history = _continued(store, req.previous_response_id).conversation
    conversation = history + input_turns(req, history)
    fields = image_fields(req, history)
    mcp_tools = mcp_tools_of(req, state.tool_servers)
    if mcp_tools:
        return await _create_with_mcp(
            state, store, req, raw_request, model, conversation, fields, mcp_tools, background
        )
    chat, plan, text, ids, params, mm_features = await _prepare(state, req, conversation, fields)
    parser = choice_parser(state, chat, plan, ids)
    request_id = item_id("resp")
    shell = _shell(req, plan, request_id, model)
    saved = _Saver(store, req.store, conversation)

    def start(stream: bool):
        return submit(
            state,
            ids,
            params,
            request_id,
            stream=stream,
            prompt=text,
            priority=chat.priority,
            cache_salt=chat.cache_salt,
            lora_request=state.lora_request(req.model),
            mm_features=mm_features,
        )

    async def whole(raw_request) -> Response:
        output, completion, parsed = await _answer(raw_request, start(False), parser)
        status = "incomplete" if completion.finish_reason == "length" else "completed"
        items = output_items(parsed, status)
        usage = _usage(
            state, len(ids), len(completion.token_ids), output.num_cached_tokens, parsed.reasoning or ""
        )
        response = _finished(shell, items, usage, completion.finish_reason)
        saved(response)
        return response

    write = EventWriter()
    if req.background:  # answered queued (or by its events); the client polls the store
        events = _events(state, shell, start(True), len(ids), parser, saved, write)
        return _background(background, shell, conversation, events, write, req.stream)
    if req.stream:
        events = _events(state, shell, start(True), len(ids), parser, saved, write)
        return StreamingResponse(_with_error_event(events, write), media_type="text/event-stream")
    return await whole(raw_request)


def _background(background: BackgroundResponses, shell, conversation, events, write, stream: bool):
    queued = background.start(shell, conversation, events, write)
    if stream:
        return StreamingResponse(background.follow(shell.id, -1), media_type="text/event-stream")
    return queued


async def _answer(raw_request, stream, parser: ChoiceParser):
    """The stream's final output, its one completion, and that completion parsed."""
    try:
        (output,) = await collect_final(raw_request, [stream])
    except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI error
        raise engine_error(e) from None
    check_finish(output)
    (completion,) = output.outputs
    return output, completion, parser.parse(completion.text)


async def _prepare(
    state: ServerState,
    req: ResponsesRequest,
    conversation: list[dict],
    fields: list[str],
    mcp_functions=(),
    tool_choice=None,
    budget: int | None = None,
    later: bool = False,
):
    """The chat path's request, tool plan, prompt text, prompt ids, SamplingParams and image features
    for one model turn (errors named as the Responses request has them; an image's by `fields`, the
    Responses field of each image part in order: responses_convert.image_fields). A `later` turn of an
    MCP response has `budget` tokens, what is left of max_output_tokens (None: the rest of the context),
    cut to the room the context leaves; None comes back when no room is left."""
    chat = to_chat_request(req, conversation, mcp_functions, tool_choice)
    parts = [(field, url) for (_, url), field in zip(image_parts(chat.messages), fields, strict=True)]
    try:
        check_image_parts(state, parts)  # before any image is read
        images = await load_images(state, parts) if parts else []
        plan = plan_tools(chat, state.enable_auto_tool_choice)
        text = apply_chat_template(state, chat.messages, True, False, chat.tools)
        if images:
            ids, mm_features = await process_images(state, text, images)
        else:
            ids, mm_features = tokenize_text(state.engine, text, False, "input"), []
        max_tokens = chat.max_tokens
        if later:
            room = state.engine.max_model_len - len(ids)
            max_tokens = min(room, budget if budget is not None else room)
            if max_tokens <= 0:
                return None
        check_context(state.engine, len(ids), max_tokens, "input")
        params = chat_sampling_params(state, chat, plan, ids, max_tokens)
    except APIError as e:
        raise rename_error(e) from None
    return chat, plan, text, ids, params, mm_features


async def _create_with_mcp(
    state, store, req: ResponsesRequest, raw_request, model: str, conversation, fields, mcp_tools, background
):
    """A response whose model may call MCP tools (`_McpResponse`), streamed, whole or in the background.
    Streamed, it starts once the tools are listed and the first turn is prepared, so a failure there is
    still an HTTP error (in the background, the response's `failed` status)."""
    run = _McpResponse(state, store, req, model, conversation, fields, mcp_tools)
    if req.stream:
        events = await run_ahead(run.events())
        return StreamingResponse(_with_error_event(events, run.write), media_type="text/event-stream")

    async def whole() -> Response:
        async for _ in run.events():
            pass
        return run.response

    if req.background:  # the tool plan is the first turn's, once listed: the request's until then
        choice = req.tool_choice
        if choice is None:
            plan = ToolPlan("auto" if req.tools else "none")
        else:
            plan = ToolPlan("named", choice.name) if not isinstance(choice, str) else ToolPlan(choice)
        shell = _shell(req, plan, run.response_id, model)
        return _background(background, shell, conversation, run.events(), run.write, req.stream)
    return await until_disconnect(raw_request, whole())


class _McpResponse:
    """Up to MAX_MCP_ROUNDS model turns: after each turn that called MCP tools, the server makes the
    calls, their outputs join the conversation and the model goes on (the last turn may not call). Its
    output: the servers' mcp_list_tools items, then each turn's items as they stream (reasoning, text, an
    mcp_call item per MCP call, with its output), `response` once `events()` has ended. The client's own
    calls end the response after its turn's MCP calls are made."""

    def __init__(self, state, store, req: ResponsesRequest, model: str, conversation, fields, mcp_tools):
        self.state, self.store, self.req, self.model = state, store, req, model
        self.conversation, self.fields, self.mcp_tools = conversation, fields, mcp_tools
        self.write = EventWriter()
        self.response: Response | None = None
        self.response_id = item_id("resp")

    async def events(self):
        state, req = self.state, self.req
        response_id = self.response_id
        totals = _Totals()
        async with McpSession(self.mcp_tools, request_function_names(req)) as session:
            items = OutputStream(self.write, session.label_of, session.needs_approval)
            conversation, approved = await _answer_approvals(self.conversation, session)
            for turn in range(MAX_MCP_ROUNDS):
                choice = "none" if turn == MAX_MCP_ROUNDS - 1 else (None if turn == 0 else "auto")
                # max_output_tokens bounds the whole response: a later turn has what the earlier left
                left = None if req.max_output_tokens is None else req.max_output_tokens - totals.num_generated
                prepared = await _prepare(
                    state, req, conversation, self.fields, session.functions, choice, left, later=turn > 0
                )
                if prepared is None:  # no tokens left for another turn: cut, as max_output_tokens cuts
                    totals.finish_reason = "length"
                    break
                chat, plan, text, ids, params, mm_features = prepared
                if turn == 0:
                    shell = _shell(req, plan, response_id, self.model)
                    yield self.write("response.created", response=shell.model_dump())
                    yield self.write("response.in_progress", response=shell.model_dump())
                    for listed in session.list_items:
                        for event in items.listed(listed):
                            yield event
                    for call in approved:
                        for event in items.made(call):
                            yield event
                kwargs = {"prompt": text, "priority": chat.priority, "cache_salt": chat.cache_salt}
                kwargs["mm_features"] = mm_features
                kwargs["lora_request"] = state.lora_request(req.model)
                stream = submit(state, ids, params, f"{response_id}-{turn}", stream=True, **kwargs)
                first = len(items.items)
                async for event in _stream_turn(stream, choice_parser(state, chat, plan, ids), items, totals):
                    yield event
                totals.num_prompt += len(ids)
                turn_items = items.items[first:]
                calls = list(items.pending)
                asked = [i for i in turn_items if isinstance(i, McpApprovalRequestOutput)]
                answer = None  # the items of the answer's chat turn: the last turn's, once finished
                if not (calls or asked) or totals.finish_reason == "length" or turn == MAX_MCP_ROUNDS - 1:
                    for call in calls:  # cut (or past the last round): not made, and not the client's to make
                        yield items.not_made(call)
                    break
                said = "".join(p.text for i in turn_items if isinstance(i, OutputMessage) for p in i.content)
                model_calls = [
                    {
                        "id": items.call_ids[c.id],
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    }
                    for c in turn_items
                    if isinstance(c, McpCallOutput | McpApprovalRequestOutput)
                ]
                conversation = [
                    *conversation,
                    {"role": "assistant", "content": said or None, "tool_calls": model_calls},
                ]
                for call in calls:
                    yield items.call_started(call)
                    await session.call(call)
                    for event in items.call_finished(call):
                        yield event
                    result = call.output if call.error is None else f"error: {call.error}"
                    conversation.append(
                        {"role": "tool", "tool_call_id": items.call_ids[call.id], "content": result}
                    )
                answer = [i for i in turn_items if isinstance(i, FunctionCallOutput)]
                if answer or asked:  # the client's calls, or its approvals, end the response (the text is
                    break  # in the conversation; the calls that wait are answered by the next request)
        status = "incomplete" if totals.finish_reason == "length" else "completed"
        for event in items.finish(status, since=first):
            yield event
        usage = _usage(state, totals.num_prompt, totals.num_generated, totals.num_cached, totals.reasoning)
        self.response = _finished(shell, items.items, usage, totals.finish_reason)
        _Saver(self.store, req.store, conversation)(
            self.response, items.items[first:] if answer is None else answer
        )
        kind = "response.incomplete" if self.response.status == "incomplete" else "response.completed"
        yield self.write(kind, response=self.response.model_dump())


async def _answer_approvals(conversation: list[dict], session: McpSession):
    """The conversation with each answer to an approval request (responses_convert.input_turns's turns
    marked APPROVAL) filled in: an approved call made now (its mcp_call item, in the list returned),
    a declined one refused in words the model reads."""
    conversation = [dict(turn) for turn in conversation]
    calls = {c["id"]: c["function"] for t in conversation for c in t.get("tool_calls") or []}
    made = []
    for turn in conversation:
        if APPROVAL not in turn:
            continue
        answer, where = turn.pop(APPROVAL)
        call = calls[turn["tool_call_id"]]
        if not answer.approve:
            turn["content"] = "The user declined this call" + (f": {answer.reason}" if answer.reason else ".")
            continue
        label = session.label_of(call["name"])
        if label is None:
            raise bad_request(
                f"the call waits on tool {call['name']!r}, which none of this request's MCP servers offers",
                f"{where}.approval_request_id",
            )
        item = McpCallOutput(
            id=item_id("mcp"),
            server_label=label,
            name=call["name"],
            arguments=call["arguments"],
            approval_request_id=answer.approval_request_id,
        )
        await session.call(item)
        turn["content"] = item.output if item.error is None else f"error: {item.error}"
        made.append(item)
    return conversation, made


class _Saver:
    """Keeps a finished response and its conversation in the store when the request said `store`."""

    def __init__(self, store: ResponseStore, is_stored: bool, conversation: list[dict]):
        self.store = store
        self.is_stored = is_stored
        self.conversation = conversation

    def __call__(self, response: Response, answer_items=None) -> None:
        """`answer_items`: the items of the assistant's last chat turn (by default the whole output; none:
        the conversation ends with the calls that wait for the client's approval)."""
        if self.is_stored:
            items = response.output if answer_items is None else answer_items
            conversation = [*self.conversation, answer_turn(items)] if items else list(self.conversation)
            self.store.put(response.id, StoredResponse(response.model_dump(), conversation))


class _Totals:
    """A response's counts over its model turns, and how its last turn ended."""

    def __init__(self) -> None:
        self.num_prompt = self.num_generated = self.num_cached = 0
        self.reasoning = ""
        self.finish_reason: str | None = None


async def _stream_turn(stream, parser: ChoiceParser, items: OutputStream, totals: _Totals):
    """One model turn's outputs as events of `items` (its open item closed at the end), counted in
    `totals`."""
    merged = merge_streams([stream])
    try:
        async for _, output in merged:
            check_finish(output)
            (completion,) = output.outputs
            totals.num_generated += len(completion.token_ids)
            totals.num_cached += output.num_cached_tokens if completion.finish_reason is not None else 0
            delta = parser.feed(completion.text) if completion.text else None
            events = items.feed(delta) if delta else []
            totals.reasoning += (delta.reasoning or "") if delta else ""
            if completion.finish_reason is not None:
                last = parser.finish()
                totals.reasoning += last.reasoning or ""
                totals.finish_reason = completion.finish_reason
                events += items.feed(last)
                events += items.close("incomplete" if completion.finish_reason == "length" else "completed")
            for event in events:
                yield event
    finally:
        await merged.aclose()


async def _with_error_event(events, write: EventWriter):
    """`events`, and an error after the headers as an `error` event that ends the stream."""
    try:
        async for event in events:
            yield event
    except Exception as e:  # noqa: BLE001 - after the headers, errors go out as an event
        error = engine_error(e)
        yield write("error", code=error.code, message=error.message, param=error.param)


async def _events(
    state, shell: Response, stream, num_prompt_tokens: int, parser: ChoiceParser, saved: _Saver, write
):
    items = OutputStream(write)
    yield write("response.created", response=shell.model_dump())
    yield write("response.in_progress", response=shell.model_dump())
    totals = _Totals()
    totals.num_prompt = num_prompt_tokens
    async for event in _stream_turn(stream, parser, items, totals):
        yield event
    status = "incomplete" if totals.finish_reason == "length" else "completed"
    for event in items.finish(status):
        yield event
    usage = _usage(state, totals.num_prompt, totals.num_generated, totals.num_cached, totals.reasoning)
    response = _finished(shell, items.items, usage, totals.finish_reason)
    saved(response)
    kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
    yield write(kind, response=response.model_dump())
