"""An Anthropic request as a chat completions request (`ChatCompletionRequest`), so it takes the chat
path: the same template rendering (tools, earlier calls, tool results), tool plan (structured outputs
for a forced call) and output parsers (`--tool-call-parser`, `--reasoning-parser`).

Anthropic's shapes map onto OpenAI's: `system` is the first message; an assistant's tool_use blocks
are its `tool_calls` (the input as JSON text), thinking its `reasoning_content`; each tool_result is a
`tool` message; tool_choice auto/any/tool/none is "auto"/"required"/a named function/"none", and
disable_parallel_tool_use is parallel_tool_calls=false; a final assistant message is a prefill
(continue_final_message); output_config.format is a json_schema response_format; thinking is the
template's enable_thinking, set over vLLM's chat_template_kwargs (passed on as on the chat route). What
the chat request's schema would name by OpenAI's fields is checked here first, each a 400 naming
Anthropic's: a block in the wrong role, a tool_result whose tool_use_id no earlier tool_use has, a
repeated tool_use id or tool name, a tool_choice naming a tool not given, an input_schema or
output_config.format.schema that llguidance cannot compile (or an input_schema that is not an
object's), an output format beside a forced tool_choice.
"""

from __future__ import annotations

import json

from pydantic import ValidationError

from xlaserve.engine.structured_output import check_grammar
from xlaserve.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    ImageBlockParam,
    McpToolResultBlockParam,
    McpToolUseBlockParam,
    MessageParam,
    MessagesRequest,
    TextBlockParam,
    ThinkingBlockParam,
    ToolParam,
    ToolResultBlockParam,
    ToolUseBlockParam,
)
from xlaserve.entrypoints.serving.chat_protocol import ChatCompletionRequest
from xlaserve.entrypoints.serving.errors import bad_request, loc_to_param
from xlaserve.structured_outputs_params import StructuredOutputsError, StructuredOutputsParams

_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def to_chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    return chat_request(chat_body(req))


def chat_body(req: CountTokensRequest, mcp_functions: list[dict] = ()) -> dict:
    """The chat request's fields for `req`, offering the MCP servers' tools (`mcp_functions`) after the
    request's own."""
    body: dict = {"messages": _messages(req)}
    last = req.messages[-1]
    is_prefill = last.role == "assistant" and all(isinstance(b, TextBlockParam) for b in last.content)
    if is_prefill and not last.content:
        body["messages"].pop()  # an empty prefill: the answer starts from nothing, as without it
        is_prefill = False
    body["add_generation_prompt"] = not is_prefill
    body["continue_final_message"] = is_prefill
    tools = (_function_tools(req.tools) or []) + [{"type": "function", "function": f} for f in mcp_functions]
    if tools:
        body["tools"] = tools
    choice = req.tool_choice
    if choice is not None:
        _check_tool_choice(req, [tool["function"]["name"] for tool in tools])
        is_named = choice.type == "tool"
        body["tool_choice"] = (
            {"type": "function", "function": {"name": choice.name}}
            if is_named
            else _TOOL_CHOICES[choice.type]
        )
        if getattr(choice, "disable_parallel_tool_use", False):
            body["parallel_tool_calls"] = False
    kwargs = dict(req.chat_template_kwargs or {})
    if req.thinking is not None:
        # Templates that think by default (Qwen3's) close the thinking when told so; others ignore it.
        kwargs["enable_thinking"] = req.thinking.type != "disabled"
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    output_format = req.output_config.format if req.output_config is not None else None
    if output_format is not None:
        if choice is not None and choice.type in ("any", "tool"):
            raise bad_request(
                f"output_config.format cannot be combined with tool_choice of type {choice.type!r}: "
                "both constrain the whole answer",
                "output_config.format",
            )
        json_schema = {"name": "output", "schema": _output_schema(output_format.schema_)}
        body["response_format"] = {"type": "json_schema", "json_schema": json_schema}
    if isinstance(req, MessagesRequest):
        sampling = {
            # Pre-warming (max_tokens 0) samples one token, dropped from the answer: the engine has no
            # prompt-only request, and the prompt's blocks reach the prefix cache either way.
            "max_tokens": req.max_tokens or 1,
            "stop": req.stop_sequences,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "stream": req.stream,
            "cache_salt": req.cache_salt,
        }
        body.update({k: v for k, v in sampling.items() if v is not None})
        if req.kv_transfer_params is not None:
            body["kv_transfer_params"] = req.kv_transfer_params.model_dump(exclude_none=True)
    return body


def chat_request(body: dict) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:  # a limit of the chat request's that Anthropic's shapes do not state
        error = e.errors()[0]
        param = loc_to_param(tuple(error.get("loc", ())))
        raise bad_request(f"this request cannot be served: {param or 'body'}: {error.get('msg')}") from None


def _messages(req: CountTokensRequest) -> list[dict]:
    conversation = []
    if req.system:
        conversation.append({"role": "system", "content": _joined(req.system)})
    tool_use_ids: set[str] = set()
    for i, message in enumerate(req.messages):
        is_final = i == len(req.messages) - 1
        if not message.content and not (is_final and message.role == "assistant"):
            raise bad_request(
                f"messages[{i}].content is empty: every message but a final assistant one needs content",
                f"messages[{i}].content",
            )
        if message.role == "assistant":
            conversation += _assistant_turns(message, i, tool_use_ids)
        else:
            conversation += _user_turns(message, i, tool_use_ids)
    return conversation


def _joined(blocks: list[TextBlockParam]) -> str:
    return "".join(block.text for block in blocks)


def _assistant_turns(message: MessageParam, i: int, tool_use_ids: set[str]) -> list[dict]:
    """An assistant message as template messages: one assistant turn, or with the MCP connector's blocks
    (an earlier answer sent back), a turn up to each run of mcp_tool_result blocks (its mcp_tool_use
    blocks among its tool_calls), then each result a `tool` message, then the rest."""
    turns: list[dict] = []
    text, reasoning, calls = [], [], []
    for j, block in enumerate(message.content):
        where = f"messages[{i}].content[{j}]"
        if isinstance(block, McpToolResultBlockParam):
            if block.tool_use_id not in {call["id"] for call in calls} | _made(turns):
                raise bad_request(
                    f"{where}.tool_use_id: no mcp_tool_use block with id {block.tool_use_id!r} comes before "
                    "this mcp_tool_result in its message",
                    f"{where}.tool_use_id",
                )
            if calls or text or reasoning:
                turns.append(_assistant(text, reasoning, calls))
                text, reasoning, calls = [], [], []
            turns.append(tool_turn(block.tool_use_id, _joined(block.content or []), bool(block.is_error)))
        elif isinstance(block, TextBlockParam):
            text.append(block.text)
        elif isinstance(block, ThinkingBlockParam):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlockParam | McpToolUseBlockParam):
            if block.id in tool_use_ids:
                raise bad_request(f"{where}.id: the tool_use id {block.id!r} is used twice", f"{where}.id")
            tool_use_ids.add(block.id)
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(
                {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}}
            )
        elif isinstance(block, (ToolResultBlockParam, ImageBlockParam)):
            raise bad_request(f"{where}: {block.type} blocks belong in user messages", where)
        # redacted_thinking: opaque data from Anthropic's own models; nothing a template can show.
    if calls or text or reasoning or not turns:
        turns.append(_assistant(text, reasoning, calls))
    return turns


def assistant_history(blocks: list[dict]) -> list[dict]:
    """An answer's blocks (as the client reads them) as the template messages they become when the
    client sends them back as an assistant message: how the MCP connector's later turns see the earlier
    ones, thinking (reasoning_content), calls and results alike."""
    message = MessageParam.model_validate({"role": "assistant", "content": blocks})
    return _assistant_turns(message, 0, set())


def _made(turns: list[dict]) -> set[str]:
    return {call["id"] for turn in turns for call in turn.get("tool_calls") or ()}


def _assistant(text: list[str], reasoning: list[str], calls: list[dict]) -> dict:
    turn: dict = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        turn["reasoning_content"] = "".join(reasoning)
    if calls:
        turn["tool_calls"] = calls
    return turn


def _user_turns(message: MessageParam, i: int, tool_use_ids: set[str]) -> list[dict]:
    """A user message as template messages: each tool_result its own `tool` message, text between
    them a `user` message, in the order sent."""
    turns, text = [], []
    for j, block in enumerate(message.content):
        where = f"messages[{i}].content[{j}]"
        if isinstance(block, TextBlockParam):
            text.append(block.text)
        elif isinstance(block, ImageBlockParam):  # an OpenAI image part (serving/multimodal.py loads it)
            text.append({"type": "image_url", "image_url": {"url": _image_url(block)}})
        elif isinstance(block, ToolResultBlockParam) and block.type == "tool_result":
            if block.tool_use_id not in tool_use_ids:
                raise bad_request(
                    f"{where}.tool_use_id: no tool_use block with id {block.tool_use_id!r} comes before "
                    "this tool_result",
                    f"{where}.tool_use_id",
                )
            if text:
                turns.append({"role": "user", "content": _user_content(text)})
                text = []
            turns.append(tool_turn(block.tool_use_id, _joined(block.content or []), bool(block.is_error)))
        else:
            raise bad_request(f"{where}: {block.type} blocks belong in assistant messages", where)
    if text or not turns:
        turns.append({"role": "user", "content": _user_content(text)})
    return turns


def tool_turn(tool_use_id: str, content: str, is_error: bool) -> dict:
    """A tool result as the template's `tool` message."""
    return {
        "role": "tool",
        "tool_call_id": tool_use_id,
        "content": f"Error: {content}" if is_error else content,
    }


def _image_url(block: ImageBlockParam) -> str:
    source = block.source
    return f"data:{source.media_type};base64,{source.data}" if source.type == "base64" else source.url


def _user_content(pieces: list) -> str | list[dict]:
    """Text pieces joined; with images among them, OpenAI content parts in the order sent."""
    if all(isinstance(p, str) for p in pieces):
        return "".join(pieces)
    return [{"type": "text", "text": p} if isinstance(p, str) else p for p in pieces]


def image_fields(req: CountTokensRequest) -> list[str]:
    """Anthropic's field of each image block, in the order `to_chat_request` turns them into parts."""
    return [
        f"messages[{i}].content[{j}].source"
        for i, message in enumerate(req.messages)
        for j, block in enumerate(message.content)
        if isinstance(block, ImageBlockParam)
    ]


def _function_tools(tools: list[ToolParam] | None) -> list[dict] | None:
    if not tools:
        return None
    seen: set[str] = set()
    out = []
    for i, tool in enumerate(tools):
        if tool.name in seen:
            raise bad_request(
                f"tools[{i}].name: the tool name {tool.name!r} is used twice", f"tools[{i}].name"
            )
        seen.add(tool.name)
        schema = input_schema(tool, i)
        function = {"name": tool.name, "parameters": schema}
        if tool.description is not None:
            function["description"] = tool.description
        if tool.strict is not None:
            function["strict"] = tool.strict
        out.append({"type": "function", "function": function})
    return out


def input_schema(tool: ToolParam, i: int) -> dict:
    """The tool's input_schema, checked: it describes an object and llguidance compiles it (so a
    forced call can be constrained by it). A schema without `type` is taken to be an object's."""
    param = f"tools[{i}].input_schema"
    schema = tool.input_schema
    if schema.get("type", "object") != "object":
        raise bad_request(
            f"{param} must describe an object ('type': 'object'), got {schema['type']!r}", param
        )
    schema = {"type": "object", **schema}
    try:
        check_grammar(StructuredOutputsParams(json=schema))
    except StructuredOutputsError as e:
        raise bad_request(f"{param} {e.reason}", param) from None
    return schema


def _output_schema(schema: dict) -> dict:
    """output_config.format.schema, checked: llguidance compiles it."""
    param = "output_config.format.schema"
    try:
        check_grammar(StructuredOutputsParams(json=schema))
    except StructuredOutputsError as e:
        raise bad_request(f"{param} {e.reason}", param) from None
    return schema


def _check_tool_choice(req: CountTokensRequest, names: list[str]) -> None:
    choice = req.tool_choice
    if choice is None or choice.type == "none":
        return
    if not names:
        raise bad_request(f"tool_choice of type {choice.type!r} needs tools", "tool_choice")
    if choice.type == "tool" and choice.name not in names:
        raise bad_request(f"tool_choice.name: no tool named {choice.name!r} in tools", "tool_choice.name")
