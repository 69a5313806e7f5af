"""Tools in chat requests: which calls a request allows, the grammar that enforces `required` and a
named function, and how tools and earlier calls reach the chat template.

tool_choice, as in vLLM:
- "none": the tools are shown to the model (in the template), no call is parsed;
- "auto": the model decides; its text is read by the server's `--tool-call-parser`. Needs
  `--enable-auto-tool-choice` (otherwise 400). With tools and no tool_choice, auto is the default when
  the server enables it, none otherwise;
- "required": the output is forced (structured outputs) to a JSON list of `{"name", "parameters"}`
  objects, one of the tools each (one at most with parallel_tool_calls=false);
- {"type": "function", "function": {"name": N}}: the output is forced to N's parameters.

A template that takes no `tools` (SmolLM2's) gets them in the system prompt instead (`TOOLS_PROMPT`,
in hermes' `<tool_call>` format), and earlier calls in assistant messages as that format's text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from xlaserve.engine.structured_output import check_grammar
from xlaserve.entrypoints.serving.chat_protocol import ChatCompletionRequest, ChatMessage
from xlaserve.entrypoints.serving.errors import bad_request
from xlaserve.structured_outputs_params import StructuredOutputsError, StructuredOutputsParams

_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more of these functions. Their signatures:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "To call a function, write a JSON object with its name and arguments between <tool_call> tags:\n"
    '<tool_call>\n{{"name": <function name>, "arguments": <arguments object>}}\n</tool_call>'
)
# apply_chat_template's own arguments: chat_template_kwargs may not set them.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
     "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask of the server."""

    choice: str  # "none", "auto", "required" or "named"
    function_name: str | None = None  # "named": the function
    structured_outputs: StructuredOutputsParams | None = None  # "required" and "named": the grammar

    @property
    def is_forced(self) -> bool:
        """The answer is calls only (a grammar makes it so)."""
        return self.choice in ("required", "named")


def plan_tools(req: ChatCompletionRequest, enable_auto_tool_choice: bool) -> ToolPlan:
    """The request's tool_choice, checked against its tools and the server (a 400 naming the field)."""
    choice = req.tool_choice
    if choice == "auto" and not enable_auto_tool_choice:
        raise bad_request(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
            "tool_choice",
        )
    if choice is None:
        choice = "auto" if req.tools and enable_auto_tool_choice else "none"
    if not req.tools:
        if choice in ("none", "auto"):
            return ToolPlan("none")
        raise bad_request("tool_choice other than 'none' or 'auto' needs 'tools'", "tool_choice")
    seen: set[str] = set()
    for i, tool in enumerate(req.tools):
        if tool.function.name in seen:
            raise bad_request(f"two tools are named {tool.function.name!r}", f"tools[{i}].function.name")
        seen.add(tool.function.name)
    if choice in ("none", "auto"):
        return ToolPlan(choice)
    if req.response_format is not None and req.response_format.type != "text" or req.structured_outputs:
        raise bad_request(
            "tool_choice 'required' or a named function already constrains the output; "
            "it cannot be combined with response_format or structured_outputs",
            "tool_choice",
        )
    for i, tool in enumerate(req.tools):  # each schema on its own first, so the error names its tool
        _checked({"json": tool.function.parameters or _NO_PARAMETERS}, f"tools[{i}].function.parameters")
    if choice == "required":
        schema = required_schema(req)
        return ToolPlan("required", structured_outputs=_checked({"json": schema}, "tools"))
    name = choice.function.name
    tool = next((t for t in req.tools if t.function.name == name), None)
    if tool is None:
        raise bad_request(
            f"tool_choice names the function {name!r}, which is not in 'tools'", "tool_choice.function.name"
        )
    parameters = tool.function.parameters or _NO_PARAMETERS
    return ToolPlan("named", name, _checked({"json": parameters}, "tool_choice"))


def required_schema(req: ChatCompletionRequest) -> dict:
    """A JSON list of calls, each `{"name": one of the tools, "parameters": its arguments}`."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": tool.function.parameters or _NO_PARAMETERS,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in req.tools
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


def _checked(spec: dict, param: str) -> StructuredOutputsParams:
    try:
        params = StructuredOutputsParams(**spec)
        check_grammar(params)
        return params
    except StructuredOutputsError as e:
        raise bad_request(f"{param} {e.reason}", param) from None


# -- the prompt --------------------------------------------------------------------------------------


def template_takes_tools(template: str | None) -> bool:
    """Does the template render a `tools` variable (else the tools go into the system prompt)?"""
    return isinstance(template, str) and "tools" in template


def check_history(messages: list[ChatMessage]) -> None:
    """Tool messages answer a call an earlier assistant message made; calls carry JSON arguments."""
    call_ids: set[str] = set()
    for i, message in enumerate(messages):
        if message.tool_calls and message.role != "assistant":
            raise bad_request("only assistant messages carry tool_calls", f"messages[{i}].tool_calls")
        for j, call in enumerate(message.tool_calls or []):
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                raise bad_request(
                    "must be a JSON object, as text", f"messages[{i}].tool_calls[{j}].function.arguments"
                )
            call_ids.add(call.id)
        if message.role == "tool":
            if message.tool_call_id is None:
                raise bad_request("a tool message needs 'tool_call_id'", f"messages[{i}].tool_call_id")
            if message.tool_call_id not in call_ids:
                raise bad_request(
                    f"tool_call_id {message.tool_call_id[:64]!r} answers no earlier assistant tool call",
                    f"messages[{i}].tool_call_id",
                )
        elif message.tool_call_id is not None:
            raise bad_request("only tool messages carry tool_call_id", f"messages[{i}].tool_call_id")


def render_calls(entry: dict, message: ChatMessage, takes_tools: bool) -> None:
    """An assistant message's calls as the template wants them: a `tool_calls` list whose arguments are
    objects (as HF templates expect; vLLM does the same), or, for a template without tools, as
    `<tool_call>` text after the content."""
    if message.tool_calls is None:
        return
    calls = [
        {
            "id": c.id,
            "type": "function",
            "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)},
        }
        for c in message.tool_calls
    ]
    if takes_tools:
        entry["tool_calls"] = calls
        return
    text = "\n".join(
        "<tool_call>\n"
        + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
        + "\n</tool_call>"
        for c in calls
    )
    entry["content"] = with_text(entry["content"], text, "\n")


def with_text(content: str | list[dict], text: str, sep: str) -> str | list[dict]:
    """`text` after a message's content: a string's after `sep`, or a list of parts'
    (--chat-template-content-format openai) as a part of its own."""
    if isinstance(content, list):
        return [*content, {"type": "text", "text": text}]
    return f"{content}{sep}{text}" if content else text


def tools_in_system_prompt(conversation: list[dict], tools: list[dict]) -> list[dict]:
    """The conversation with the tools described in its system message (one is added if none)."""
    text = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
    if conversation and conversation[0]["role"] == "system":
        first = dict(conversation[0], content=with_text(conversation[0]["content"], text, "\n\n"))
        return [first, *conversation[1:]]
    return [{"role": "system", "content": text}, *conversation]


def template_kwargs(req_kwargs: dict | None) -> dict:
    """chat_template_kwargs, minus anything that would change how the template is called."""
    if not req_kwargs:
        return {}
    for key in req_kwargs:
        if key in _RESERVED_TEMPLATE_KWARGS or not key.isidentifier():
            raise bad_request(
                f"{key[:64]!r} cannot be set through chat_template_kwargs", f"chat_template_kwargs.{key[:64]}"
            )
    return dict(req_kwargs)
