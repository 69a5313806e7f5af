"""An Anthropic request as the chat path's input: the conversation a chat template reads (OpenAI's
message dicts: `tool_calls` on assistant turns, `tool` messages for results), the tools as OpenAI
function tools, and the request's sampling parameters.

What the schema cannot say is checked here, each a 400 naming the field: a block in the wrong role,
a tool_result whose tool_use_id no earlier tool_use has, a repeated tool_use id or tool name, a
tool_choice naming a tool that is not given, an input_schema that llguidance cannot compile.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from jinja2 import TemplateError

from xlaserve.engine.structured_output import check_grammar
from xlaserve.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    MessageParam,
    MessagesRequest,
    TextBlockParam,
    ThinkingBlockParam,
    ToolParam,
    ToolResultBlockParam,
    ToolUseBlockParam,
)
from xlaserve.entrypoints.openai.errors import bad_request
from xlaserve.entrypoints.openai.serving import ServerState
from xlaserve.sampling_params import SamplingParams, StructuredOutputsError, StructuredOutputsParams

logger = logging.getLogger("xlaserve.entrypoints.anthropic")


@dataclass
class ChatPrompt:
    """What the chat template renders."""

    conversation: list[dict]
    tools: list[dict] | None  # OpenAI's function tools: {"type": "function", "function": {...}}
    # A final assistant message is a prefill the answer continues (Anthropic's "put words in its mouth").
    continue_final_message: bool


def to_chat(req: CountTokensRequest) -> ChatPrompt:
    tools = _function_tools(req.tools)
    _check_tool_choice(req)
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
            conversation.append(_assistant_turn(message, i, tool_use_ids))
        else:
            conversation += _user_turns(message, i, tool_use_ids)
    last = req.messages[-1]
    is_prefill = last.role == "assistant" and all(isinstance(b, TextBlockParam) for b in last.content)
    if is_prefill and not last.content:
        conversation.pop()  # an empty prefill: the answer starts from nothing, as without it
        is_prefill = False
    return ChatPrompt(conversation, tools, continue_final_message=is_prefill)


def _joined(blocks: list[TextBlockParam]) -> str:
    return "".join(block.text for block in blocks)


def _assistant_turn(message: MessageParam, i: int, tool_use_ids: set[str]) -> dict:
    text, reasoning, calls = [], [], []
    for j, block in enumerate(message.content):
        where = f"messages[{i}].content[{j}]"
        if isinstance(block, TextBlockParam):
            text.append(block.text)
        elif isinstance(block, ThinkingBlockParam):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlockParam):
            if block.id in tool_use_ids:
                raise bad_request(f"{where}.id: the tool_use id {block.id!r} is used twice", f"{where}.id")
            tool_use_ids.add(block.id)
            # Templates read the arguments as a mapping (they apply `tojson` themselves).
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": block.input},
                }
            )
        elif isinstance(block, ToolResultBlockParam):
            raise bad_request(f"{where}: tool_result blocks belong in user messages", where)
        # redacted_thinking: opaque data from Anthropic's own models; nothing a template can show.
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
        elif isinstance(block, ToolResultBlockParam):
            if block.tool_use_id not in tool_use_ids:
                raise bad_request(
                    f"{where}.tool_use_id: no tool_use block with id {block.tool_use_id!r} comes before "
                    "this tool_result",
                    f"{where}.tool_use_id",
                )
            if text:
                turns.append({"role": "user", "content": "".join(text)})
                text = []
            content = _joined(block.content or [])
            if block.is_error:
                content = f"Error: {content}"
            turns.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        else:
            raise bad_request(f"{where}: {block.type} blocks belong in assistant messages", where)
    if text or not turns:
        turns.append({"role": "user", "content": "".join(text)})
    return turns


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


def _check_tool_choice(req: CountTokensRequest) -> None:
    choice = req.tool_choice
    if choice is None or choice.type == "none":
        return
    names = [tool.name for tool in req.tools or []]
    if not names:
        raise bad_request(f"tool_choice of type {choice.type!r} needs tools", "tool_choice")
    if choice.type == "tool" and choice.name not in names:
        raise bad_request(f"tool_choice.name: no tool named {choice.name!r} in tools", "tool_choice.name")


def render(state: ServerState, prompt: ChatPrompt) -> str:
    """The prompt text, through the served chat template (tools passed to templates that take them)."""
    tokenizer = state.engine.tokenizer
    if state.chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise bad_request(
            "this model has no chat template; start the server with --chat-template", "messages"
        )
    try:
        return tokenizer.apply_chat_template(
            prompt.conversation,
            tools=prompt.tools,
            chat_template=state.chat_template,
            tokenize=False,
            add_generation_prompt=not prompt.continue_final_message,
            continue_final_message=prompt.continue_final_message,
        )
    except Exception as e:  # noqa: BLE001 - the template's raise_exception(), or a template bug
        if type(e) is TemplateError:  # raise_exception(message): the template's words, meant for users
            raise bad_request(f"the chat template rejects these messages: {e}", "messages") from None
        logger.warning("the chat template failed: %s: %s", type(e).__name__, e)
        raise bad_request("the chat template cannot render these messages", "messages") from None


def sampling_params(req: MessagesRequest, constraint: StructuredOutputsParams | None) -> SamplingParams:
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            max_tokens=req.max_tokens,
            stop=req.stop_sequences,
            structured_outputs=constraint,
        )
    except ValueError as e:
        raise bad_request(str(e)) from None


def arguments_text(arguments: dict) -> str:
    return json.dumps(arguments, ensure_ascii=False)
