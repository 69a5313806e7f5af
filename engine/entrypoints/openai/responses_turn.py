"""What one Responses turn is made of, shared by the one-turn route (responses.py) and the MCP turn loop
(responses_mcp.py): the turn's chat-path preparation, the response's shell and its finished form, its
output items and usage, the streamed turn's events, and the saver that stores the answer's chat turn."""

from __future__ import annotations

import json
import time

from fastapi.responses import StreamingResponse

from xlaserve.entrypoints.openai.logprobs import token_logprobs
from xlaserve.entrypoints.openai.responses_background import BackgroundResponses
from xlaserve.entrypoints.openai.responses_convert import rename_error, to_chat_request
from xlaserve.entrypoints.openai.responses_harmony import TurnParser
from xlaserve.entrypoints.openai.responses_output import (
    FunctionCallOutput,
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputTokensDetails,
    ReasoningOutput,
    Response,
    ResponseUsage,
)
from xlaserve.entrypoints.openai.responses_protocol import MCP_SECRETS, ResponsesRequest
from xlaserve.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from xlaserve.entrypoints.openai.responses_stream import EventWriter, OutputStream, item_id
from xlaserve.entrypoints.serving.chat_parsing import ChoiceParser
from xlaserve.entrypoints.serving.chat_path import chat_sampling_params
from xlaserve.entrypoints.serving.chat_template import apply_chat_template
from xlaserve.entrypoints.serving.engine_io import (
    check_context,
    check_finish,
    default_max_tokens,
    drain,
    engine_error,
    merge_streams,
    request_ids,
    resolve_num_logprobs,
    run_ahead,
    tokenize_text,
    truncated,
)
from xlaserve.entrypoints.serving.errors import APIError
from xlaserve.entrypoints.serving.multimodal import image_parts, load_media, process_images, video_parts
from xlaserve.entrypoints.serving.state import ServerState
from xlaserve.entrypoints.serving.tools import ToolPlan, plan_tools


async def prepare_turn(
    state: ServerState,
    req: ResponsesRequest,
    conversation: list[dict],
    fields: dict[str, list[str]],
    mcp_functions=(),
    tool_choice=None,
    budget: int | None = None,
    later: bool = False,
):
    """The chat path's request, tool plan, prompt text, prompt ids, SamplingParams and media features
    for one model turn (errors named as the Responses request has them; an image's or video's by
    `fields`, the Responses field of each image_url and video_url part in order: responses_convert.
    media_fields). A `later` turn of an MCP response has `budget` tokens, what is left of
    max_output_tokens (None: the rest of the context), cut to the room the context leaves; None comes
    back when no room is left."""
    chat = to_chat_request(req, conversation, mcp_functions, tool_choice)
    # vLLM's -1, the whole vocabulary, as a count (the chat route's rule); the response echoes the -1.
    resolve_num_logprobs(state.engine, chat, "top_logprobs")
    image_fields, video_fields = fields["image_url"], fields["video_url"]
    images = [(field, url) for (_, url), field in zip(image_parts(chat.messages), image_fields, strict=True)]
    videos = [(field, url) for (_, url), field in zip(video_parts(chat.messages), video_fields, strict=True)]
    try:
        images, videos = await load_media(state, images, videos)
        plan = plan_tools(chat, state.enable_auto_tool_choice)
        text = apply_chat_template(state, chat.messages, True, False, chat.tools, chat.chat_template_kwargs)
        if images or videos:
            ids, mm_features = await process_images(state, text, images, videos, video_fields)
        else:
            ids, mm_features = tokenize_text(state.engine, text, False, "input"), []
        if req.truncation == "auto":
            cut = truncated(state.engine, ids, -1, bool(mm_features), chat.max_tokens)
            ids, text = cut, (text if cut is ids else None)  # the rendered text is not the prompt's any more
        max_tokens = default_max_tokens(state, chat.max_tokens, len(ids))
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


def response_ids(raw_request, req: ResponsesRequest) -> tuple[str, str]:
    """A new response's id (the store's key, so never a client's) and the engine's id for it: the
    client's (its X-Request-Id header, else the body's request_id, checked as on the chat route) after
    `resp-` with 8 random hex digits more, else the response's own."""
    response_id = item_id("resp")
    if raw_request.headers.get("x-request-id") is None and req.request_id is None:
        return response_id, response_id
    return response_id, request_ids(raw_request, "resp", req.request_id)[1]


def response_shell(req: ResponsesRequest, plan: ToolPlan, request_id: str, model: str) -> Response:
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
        top_logprobs=req.top_logprobs,
        max_tool_calls=req.max_tool_calls,
        truncation=req.truncation or "disabled",
        service_tier=req.service_tier or "auto",
    )


def finished(state: ServerState, shell: Response, items, totals: Totals) -> Response:
    """The response once its turns have ended: `items` its output, `totals` its usage and status."""
    is_cut = totals.status == "incomplete"
    return shell.model_copy(
        update={
            "status": totals.status,
            "incomplete_details": IncompleteDetails(reason="max_output_tokens") if is_cut else None,
            "output": items,
            "usage": _usage(state, totals),
            "kv_transfer_params": totals.kv_transfer_params,
        }
    )


def end_event(write: EventWriter, response: Response) -> str:
    """The stream's last event: response.completed, or response.incomplete (cut by max_output_tokens)."""
    kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
    return write(kind, response=response.model_dump())


def _usage(state: ServerState, totals: Totals) -> ResponseUsage:
    tokenizer = state.engine.tokenizer
    reasoning = totals.reasoning
    num_reasoning = len(tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
    num_prompt, num_generated = totals.num_prompt, totals.num_generated
    return ResponseUsage(
        input_tokens=num_prompt,
        input_tokens_details=InputTokensDetails(cached_tokens=totals.num_cached),
        output_tokens=num_generated,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=min(num_reasoning, num_generated)),
        total_tokens=num_prompt + num_generated,
    )


def answer_turn(items) -> dict:
    """The response's output as the assistant's chat turn, for a later request to continue."""
    text = "".join(p.text for item in items if isinstance(item, OutputMessage) for p in item.content)
    turn: dict = {"role": "assistant", "content": text}
    thought = "\n".join(p.text for item in items if isinstance(item, ReasoningOutput) for p in item.content)
    if thought:
        turn["reasoning_content"] = thought
    calls = [
        {"id": i.call_id, "type": "function", "function": {"name": i.name, "arguments": i.arguments}}
        for i in items
        if isinstance(i, FunctionCallOutput) and _is_object(i.arguments)
    ]
    if calls:
        turn["tool_calls"] = calls
    return turn


def cut_calls(response: dict) -> set[str]:
    """The call ids of a stored response's function calls that `answer_turn` leaves out of the history:
    those cut by max_output_tokens before their arguments were a whole JSON object."""
    return {
        item["call_id"]
        for item in response["output"]
        if item["type"] == "function_call" and not _is_object(item["arguments"])
    }


def _is_object(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


class Saver:
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


class Totals:
    """A response's counts over its model turns, and how its last turn ended."""

    def __init__(self) -> None:
        self.num_prompt = self.num_generated = self.num_cached = 0
        self.reasoning = ""
        self.finish_reason: str | None = None
        self.kv_transfer_params: dict | None = None  # a producer's last turn's (disaggregated prefill)

    @property
    def status(self) -> str:
        """The response's: "incomplete" when its last turn was cut by max_output_tokens."""
        return "incomplete" if self.finish_reason == "length" else "completed"


async def stream_turn(
    state: ServerState, stream, parser: ChoiceParser, items: OutputStream, totals: Totals, top_n: int | None
):
    """One model turn's outputs as events of `items` (its open item closed at the end), counted in
    `totals`; with `top_n` (the request's `include` asked for logprobs), each token's logprob and its
    alternatives go to `items`, which gives the message text's tokens to the message."""
    merged = merge_streams([stream])
    turn = TurnParser(parser)
    try:
        async for _, output in merged:
            check_finish(output)
            (completion,) = output.outputs
            totals.num_generated += len(completion.token_ids)
            totals.num_cached += output.num_cached_tokens if completion.finish_reason is not None else 0
            deltas = turn.feed(completion.text) if completion.text else [None]
            logprobs = []
            if top_n is not None and completion.token_ids:
                logprobs = [entry.model_dump() for entry in token_logprobs(state, completion, top_n)]
            # The step's logprobs go with its first answer text (or its last delta): a step of several
            # harmony messages (several tokens) gives its tokens to the answer, as one delta would.
            owner = next((i for i, d in enumerate(deltas) if d and d.content), len(deltas) - 1)
            events = []
            for i, delta in enumerate(deltas):
                step_logprobs = logprobs if i == owner else []
                events += items.feed(delta, step_logprobs) if delta or step_logprobs else []
                totals.reasoning += (delta.reasoning or "") if delta else ""
            if completion.finish_reason is not None:
                for last in turn.finish():
                    totals.reasoning += last.reasoning or ""
                    events += items.feed(last)
                totals.finish_reason = completion.finish_reason
                totals.kv_transfer_params = output.kv_transfer_params
                events += items.close("incomplete" if completion.finish_reason == "length" else "completed")
            for event in events:
                yield event
    finally:
        await merged.aclose()


async def reply(
    run, req: ResponsesRequest, raw_request, background: BackgroundResponses, shell, conversation
):
    """The answer to a request `run` (a response's turns: `events()`, its `write`, `response` once its
    events have ended) serves: in the background (queued, or its events as made), streamed (once its
    first event is ready, so a failure before it is still an HTTP error), or whole (its events drained,
    an error as the HTTP error; the client leaving aborts it)."""
    if req.background:  # answered queued (or by its events); the client polls the store
        return in_background(background, shell, conversation, run.events(), run.write, req.stream)
    if req.stream:
        events = await run_ahead(run.events())
        return StreamingResponse(with_error_event(events, run.write), media_type="text/event-stream")

    await drain(raw_request, run.events())
    return run.response


async def with_error_event(events, write: EventWriter):
    """`events`, and an error after the headers as an `error` event that ends the stream."""
    try:
        async for event in events:
            yield event
    except Exception as e:  # noqa: BLE001 - after the headers, errors go out as an event
        error = engine_error(e)
        yield write("error", code=error.code, message=error.message, param=error.param)


def in_background(background: BackgroundResponses, shell, conversation, events, write, stream: bool):
    queued = background.start(shell, conversation, events, write)
    if stream:
        return StreamingResponse(background.follow(shell.id, -1), media_type="text/event-stream")
    return queued
