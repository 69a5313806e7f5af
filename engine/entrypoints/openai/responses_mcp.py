"""A Responses request with MCP tools: up to MAX_MCP_ROUNDS model turns, the server making the MCP calls
between them (`McpResponse.events()`, one loop for the streamed, the whole and the background answer),
and the answers to approval requests made before the first turn (`answer_approvals`)."""

from __future__ import annotations

from xlaserve.entrypoints.openai.mcp_tools import McpSession, request_function_names
from xlaserve.entrypoints.openai.responses_convert import APPROVAL
from xlaserve.entrypoints.openai.responses_output import (
    FunctionCallOutput,
    McpApprovalRequestOutput,
    McpCallOutput,
    OutputMessage,
    ReasoningOutput,
    Response,
)
from xlaserve.entrypoints.openai.responses_protocol import ResponsesRequest
from xlaserve.entrypoints.openai.responses_stream import EventWriter, OutputStream, item_id
from xlaserve.entrypoints.openai.responses_turn import (
    Saver,
    Totals,
    end_event,
    finished,
    prepare_turn,
    reply,
    response_shell,
    stream_turn,
)
from xlaserve.entrypoints.serving.chat_path import choice_parser
from xlaserve.entrypoints.serving.engine_io import submit
from xlaserve.entrypoints.serving.errors import bad_request
from xlaserve.entrypoints.serving.mcp_client import MAX_MCP_ROUNDS
from xlaserve.entrypoints.serving.tools import ToolPlan


async def create_with_mcp(
    state,
    store,
    req: ResponsesRequest,
    raw_request,
    model: str,
    conversation,
    fields,
    mcp_tools,
    background,
    response_ids: tuple[str, str],
):
    """A response whose model may call MCP tools (`McpResponse`), streamed, whole or in the background.
    Streamed, it starts once the tools are listed and the first turn is prepared, so a failure there is
    still an HTTP error (in the background, the response's `failed` status)."""
    run = McpResponse(state, store, req, model, conversation, fields, mcp_tools, response_ids)
    # Queued in the background, the response shows the request's tool plan (the first turn's, once the
    # tools are listed, replaces it).
    choice = req.tool_choice
    if choice is None:
        plan = ToolPlan("auto" if req.tools else "none")
    else:
        plan = ToolPlan("named", choice.name) if not isinstance(choice, str) else ToolPlan(choice)
    shell = response_shell(req, plan, run.response_id, model)
    return await reply(run, req, raw_request, background, shell, conversation)


class McpResponse:
    """Up to MAX_MCP_ROUNDS model turns: after each turn that called MCP tools, the server makes the
    calls, their outputs join the conversation and the model goes on (the last turn may not call). Its
    output: the servers' mcp_list_tools items, then each turn's items as they stream (reasoning, text, an
    mcp_call item per MCP call, with its output), `response` once `events()` has ended. The client's own
    calls end the response after its turn's MCP calls are made."""

    def __init__(
        self, state, store, req: ResponsesRequest, model: str, conversation, fields, mcp_tools, response_ids
    ):
        self.state, self.store, self.req, self.model = state, store, req, model
        self.conversation, self.fields, self.mcp_tools = conversation, fields, mcp_tools
        self.write = EventWriter()
        self.response: Response | None = None
        self.response_id, self.engine_id = response_ids  # responses_turn's; a turn's: engine_id-turn

    async def events(self):
        state, req = self.state, self.req
        response_id = self.response_id
        totals = Totals()
        async with McpSession(self.mcp_tools, request_function_names(req)) as session:
            items = OutputStream(self.write, session.label_of, session.needs_approval, req.include_reasoning)
            conversation, approved = await answer_approvals(self.conversation, session)
            for turn in range(MAX_MCP_ROUNDS):
                choice = "none" if turn == MAX_MCP_ROUNDS - 1 else (None if turn == 0 else "auto")
                # max_output_tokens bounds the whole response: a later turn has what the earlier left
                left = None if req.max_output_tokens is None else req.max_output_tokens - totals.num_generated
                prepared = await prepare_turn(
                    state, req, conversation, self.fields, session.functions, choice, left, later=turn > 0
                )
                if prepared is None:  # no tokens left for another turn: cut, as max_output_tokens cuts
                    totals.finish_reason = "length"
                    break
                chat, plan, text, ids, params, mm_features = prepared
                if turn == 0:
                    shell = response_shell(req, plan, response_id, self.model)
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
                stream = submit(state, ids, params, f"{self.engine_id}-{turn}", stream=True, **kwargs)
                first, first_thought = len(items.items), len(totals.reasoning)
                parser = choice_parser(state, chat, plan, ids)
                async for event in stream_turn(state, stream, parser, items, totals, params.logprobs):
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
                turn_answer = {"role": "assistant", "content": said or None, "tool_calls": model_calls}
                # The model reads its thinking back in the next turn, though the client asked not to get it.
                thought = (
                    "\n".join(p.text for i in turn_items if isinstance(i, ReasoningOutput) for p in i.content)
                    if req.include_reasoning
                    else totals.reasoning[first_thought:]
                )
                if thought:
                    turn_answer["reasoning_content"] = thought
                conversation = [*conversation, turn_answer]
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
        for event in items.finish(totals.status, since=first):
            yield event
        self.response = finished(state, shell, items.items, totals)
        Saver(self.store, req.store, conversation)(
            self.response, items.items[first:] if answer is None else answer
        )
        yield end_event(self.write, self.response)


async def answer_approvals(conversation: list[dict], session: McpSession):
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
