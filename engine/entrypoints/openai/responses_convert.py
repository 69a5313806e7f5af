"""A Responses request as a chat completions request (`ChatCompletionRequest`), so it takes the chat
path: the same template rendering (tools, earlier calls, tool results), tool plan (structured outputs
for required and named calls), sampling parameters and output parsers.

The shapes map one to one: `instructions` is a first system message (not carried over to a later
turn, as in OpenAI's API); a string `input` is a user message (an `input_image` part is chat's
image_url part; a `video_url` part is chat's own); `function_call` items are the tool_calls
of the assistant turn before them (or of a new one); each `function_call_output` is a `tool` message;
a `reasoning` item is the thinking (`reasoning_content`) of the assistant turn it begins, which the
message or calls after it join (the chat template renders it as its model does: gpt-oss's takes it
as `thinking`, serving/chat_template.py); the flat tools and tool_choice nest under "function";
`text.format` is `response_format`;
`max_output_tokens` is `max_tokens`. What the chat path would name by its own fields is checked here
first, each a 400 naming the Responses field (`input[3].call_id`); what it checks itself has its
field renamed by `rename_error`.
"""

from __future__ import annotations

import json
import re

from pydantic import ValidationError

from xlaserve.entrypoints.openai.responses_input import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputImage,
    McpApprovalRequestItem,
    McpApprovalResponseItem,
    McpCallItem,
    McpListToolsItem,
    MessageItem,
    ReasoningItem,
)
from xlaserve.entrypoints.openai.responses_protocol import (
    OUTPUT_LOGPROBS,
    FunctionTool,
    JsonSchemaFormat,
    McpTool,
    ResponsesRequest,
)
from xlaserve.entrypoints.openai.responses_stream import APPROVAL_REQUEST
from xlaserve.entrypoints.serving.chat_protocol import ChatCompletionRequest, VideoURLContentPart
from xlaserve.entrypoints.serving.errors import APIError, bad_request, loc_to_param

APPROVAL = "approval"  # the key of an answer's tool turn that waits for its MCP call (`input_turns`)
APPROVAL_PREFIX = f"{APPROVAL_REQUEST}_"  # the ids of the mcp_approval_request items this server makes

_MEDIA = (InputImage, VideoURLContentPart)  # the parts the chat path takes as its own media parts
# The chat request's field names (in `param` and in messages) -> the Responses API's.
_RENAMES = [
    (re.compile(r"\bresponse_format\.json_schema\.schema\b"), "text.format.schema"),
    (re.compile(r"\bresponse_format\b"), "text.format"),
    (re.compile(r"\btools\[(\d+)\]\.function\.(\w+)"), r"tools[\1].\2"),
    (re.compile(r"\btool_choice\.function\.name\b"), "tool_choice.name"),
    (re.compile(r"\bmax_tokens\b"), "max_output_tokens"),
    (re.compile(r"\btruncate_prompt_tokens\b"), "truncation"),
    (re.compile(r"\bmessages\[\d+\](\.\w+)*"), "input"),  # the chat messages do not index the input
]
_SAMPLING = (  # and the chat request's other fields the Responses request shares
    "temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty", "top_k", "min_p",
    "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "priority", "cache_salt", "user",
    "parallel_tool_calls", "stream", "kv_transfer_params", "chat_template_kwargs",
)  # fmt: skip


def rename(text: str) -> str:
    for pattern, replacement in _RENAMES:
        text = pattern.sub(replacement, text)
    return text


def rename_error(error: APIError) -> APIError:
    """An error of the chat path, its field named as the Responses request has it."""
    if error.param is None or error.status_code != 400:
        return error
    param = "input" if error.param.startswith("messages") else rename(error.param)
    return APIError(400, rename(error.message), param=param, code=error.code)


def input_turns(req: ResponsesRequest, history: list[dict], cut_calls: set[str] = frozenset()) -> list[dict]:
    """The request's `input` as chat messages (dicts of ChatMessage's fields), checked against itself and
    the `history` it continues: a call's arguments are a JSON object's text, call ids are unique, and
    each output answers an earlier call (not one of the `cut_calls`, the previous response's calls cut
    by max_output_tokens, which the history leaves out: there is no whole call to answer)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    call_ids = {call["id"] for turn in history for call in turn.get("tool_calls") or []}
    answered = {turn["tool_call_id"] for turn in history if turn.get("role") == "tool"}
    waiting = {i for i in call_ids - answered if i.startswith(APPROVAL_PREFIX)}  # approval requests
    turns: list[dict] = []

    def add_call(call_id: str, name: str, arguments: str, where: str) -> None:
        if call_id in call_ids:
            raise bad_request(f"the call_id {call_id[:64]!r} is used twice", where)
        call_ids.add(call_id)
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        previous = turns[-1] if turns else None
        if previous is not None and previous["role"] == "assistant":
            previous.setdefault("tool_calls", []).append(call)  # the calls of the answer before them
        else:
            turns.append({"role": "assistant", "content": None, "tool_calls": [call]})

    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if isinstance(item, MessageItem):
            previous = turns[-1] if turns else None
            if item.role == "assistant" and _is_thought_only(previous):
                previous["content"] = _message_content(item, where)  # the answer after its thinking
            else:
                turns.append({"role": item.role, "content": _message_content(item, where)})
        elif isinstance(item, FunctionCallItem):
            _check_arguments(item.arguments, f"{where}.arguments")
            add_call(item.call_id, item.name, item.arguments, f"{where}.call_id")
        elif isinstance(item, McpCallItem):  # an MCP call made earlier: the call and what it gave
            add_call(item.id, item.name, item.arguments, f"{where}.id")
            result = item.output if item.error is None else f"error: {item.error}"
            turns.append({"role": "tool", "tool_call_id": item.id, "content": result or ""})
        elif isinstance(item, McpApprovalRequestItem):
            add_call(item.id, item.name, item.arguments, f"{where}.id")
            waiting.add(item.id)
        elif isinstance(item, McpApprovalResponseItem):
            rid = item.approval_request_id
            if rid not in waiting:
                raise bad_request(
                    f"no mcp_approval_request {rid[:64]!r} waits for an answer here (send the response's "
                    "previous_response_id, or the request item, before this one)",
                    f"{where}.approval_request_id",
                )
            if not any(isinstance(tool, McpTool) for tool in req.tools or ()):
                raise bad_request(
                    "an mcp_approval_response needs the request's mcp tools: send them again", where
                )
            waiting.discard(rid)
            # Its content is the call's output once the server has made it (responses.py), or the refusal.
            turns.append({"role": "tool", "tool_call_id": rid, "content": "", APPROVAL: (item, where)})
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id in cut_calls and item.call_id not in call_ids:
                raise bad_request(
                    f"the function_call {item.call_id[:64]!r} was cut by max_output_tokens before its "
                    "arguments were whole, so it cannot be answered: send a message, or the call again "
                    "as a function_call item with whole arguments, before its output",
                    f"{where}.call_id",
                )
            if item.call_id not in call_ids:
                raise bad_request(
                    f"no function_call with call_id {item.call_id[:64]!r} comes before this output",
                    f"{where}.call_id",
                )
            output = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
            turns.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        elif isinstance(item, ReasoningItem):  # the thinking of the assistant turn it begins
            thought = "".join(part.text for part in item.content or ())
            previous = turns[-1] if turns else None
            if _is_thought_only(previous) and thought:
                previous["reasoning_content"] += "\n" + thought
            elif thought:
                turns.append({"role": "assistant", "content": None, "reasoning_content": thought})
        elif isinstance(item, McpListToolsItem):
            continue  # an MCP server's listing: listed again for this response
    return turns


def _is_thought_only(turn: dict | None) -> bool:
    """An assistant turn begun by a reasoning item, nothing else in it yet."""
    return (
        turn is not None
        and turn["role"] == "assistant"
        and "reasoning_content" in turn
        and turn["content"] is None
        and not turn.get("tool_calls")
    )


def _message_content(item: MessageItem, where: str) -> str | list[dict]:
    """A message's content for the chat path: its text, or, with images or videos (a user's only), the
    chat's text, image_url and video_url parts in order."""
    content = item.content
    if isinstance(content, str):
        return content
    if not any(isinstance(part, _MEDIA) for part in content):
        return "".join(part.text for part in content)
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, _MEDIA):
            parts.append({"type": "text", "text": part.text})
            continue
        field = f"{where}.content[{j}]"
        if item.role != "user":
            raise bad_request(f"{part.type} parts belong in a user message, not the {item.role}'s", field)
        if isinstance(part, VideoURLContentPart):
            if part.video_url is None:  # a chat part's reference by uuid alone: not this API's
                raise bad_request(
                    "no video_url; send the video as video_url (a data: URL)", f"{field}.video_url"
                )
            parts.append({"type": "video_url", "video_url": {"url": part.video_url.url}})
            continue
        if part.image_url is None:
            what = "file_id: this server has no Files API" if part.file_id is not None else "no image_url"
            raise bad_request(f"{what}; send the image as image_url (a data: URL)", f"{field}.image_url")
        parts.append({"type": "image_url", "image_url": {"url": part.image_url, "detail": part.detail}})
    return parts


def media_fields(req: ResponsesRequest, history: list[dict]) -> dict[str, list[str]]:
    """The Responses field of each image_url and video_url part of `history + input_turns(req,
    history)`, by the chat part's type, in order: a part of an earlier turn is the stored response's
    (`previous_response_id`)."""
    fields = {}
    for kind, part_type in (("image_url", InputImage), ("video_url", VideoURLContentPart)):
        earlier = sum(
            1 for turn in history if isinstance(turn.get("content"), list) for p in turn["content"]
            if p.get("type") == kind
        )  # fmt: skip
        fields[kind] = ["previous_response_id"] * earlier
        for i, item in enumerate(req.input if isinstance(req.input, list) else ()):
            if isinstance(item, MessageItem) and isinstance(item.content, list):
                fields[kind] += [
                    f"input[{i}].content[{j}].{kind}"
                    for j, part in enumerate(item.content)
                    if isinstance(part, part_type)
                ]
    return fields


def _check_arguments(arguments: str, param: str) -> None:
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise bad_request("must be a JSON object, as text", param)


def to_chat_request(
    req: ResponsesRequest, conversation: list[dict], mcp_functions: list[dict] = (), tool_choice=None
) -> ChatCompletionRequest:
    """The chat request for `conversation` (the earlier turns and this input's) under the request's
    instructions, tools, format and sampling fields. `mcp_functions`: the MCP servers' tools, offered
    as functions beside the request's own (mcp_tools.py); `tool_choice`: this round's, over the
    request's."""
    if not conversation:
        raise bad_request("input is empty: send a string or at least one item", "input")
    messages = list(conversation)
    if req.instructions is not None:
        messages.insert(0, {"role": "system", "content": req.instructions})
    body: dict = {"messages": messages}
    functions = [
        tool.model_dump(exclude_none=True, exclude={"type"})
        for tool in req.tools or ()
        if isinstance(tool, FunctionTool)
    ]
    functions += mcp_functions
    if functions:
        body["tools"] = [{"type": "function", "function": function} for function in functions]
    choice = req.tool_choice if tool_choice is None else tool_choice
    if choice is not None:
        body["tool_choice"] = (
            choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
        )
    text_format = req.text.format if req.text is not None else None
    if isinstance(text_format, JsonSchemaFormat):
        json_schema = {"name": text_format.name, "schema": text_format.schema_}
        body["response_format"] = {"type": "json_schema", "json_schema": json_schema}
    elif text_format is not None:
        body["response_format"] = {"type": text_format.type}
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    if OUTPUT_LOGPROBS in (req.include or ()):
        body["logprobs"], body["top_logprobs"] = True, req.top_logprobs or 0
    fields = req.model_dump(include=set(_SAMPLING), exclude_unset=True)
    body.update({k: v for k, v in fields.items() if v is not None})
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:  # a limit of the chat request's that the Responses shapes do not state
        error = e.errors()[0]
        param = rename(loc_to_param(tuple(error.get("loc", ()))) or "input")
        raise bad_request(f"this request cannot be served: {param}: {error.get('msg')}", param) from None
