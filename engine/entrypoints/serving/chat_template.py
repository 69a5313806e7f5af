"""Messages -> the prompt text, through the chat template: the one rendering both APIs use (an
Anthropic request arrives here as the shared chat request's messages and tools).

Tools reach the template as `tools` when it takes them, else in the system prompt; earlier calls as
the template wants them (tools.py); an assistant turn's `reasoning_content` as `thinking` to a template
that reads it (gpt-oss's; other templates are not given earlier thinking), and to that template a turn
of parallel calls as a turn per call, each followed by its output. A
template's own `raise_exception()` is a 400 in its words; any other failure is logged and a 400 that
does not quote it.
"""

from __future__ import annotations

import logging
import re

from jinja2 import TemplateError, TemplateSyntaxError

from xlaserve.engine.mm_processor import content_format
from xlaserve.entrypoints.serving.chat_protocol import ChatCompletionRequest, ChatMessage, ChatTool
from xlaserve.entrypoints.serving.engine_io import require_tokenizer
from xlaserve.entrypoints.serving.errors import bad_request
from xlaserve.entrypoints.serving.state import ServerState
from xlaserve.entrypoints.serving.tools import (
    check_history,
    render_calls,
    template_kwargs,
    template_takes_tools,
    tools_in_system_prompt,
)

logger = logging.getLogger("xlaserve.entrypoints.serving")
_MEDIA = {"image_url": "image", "video_url": "video"}  # a media part as the "openai" format gives it
# A template that reads an assistant message's `thinking` (gpt-oss's): `message.thinking`,
# `message['thinking']`, `"thinking" in message`; not Qwen3's `enable_thinking` flag.
_READS_THINKING = re.compile(
    r"""\.thinking\b|\[\s*['"]thinking['"]\s*\]|['"]thinking['"]\s+(?:not\s+)?in\b"""
)


def template_takes_thinking(template: str | None) -> bool:
    """Does the template render an assistant message's thinking as `thinking` (gpt-oss's)?"""
    return isinstance(template, str) and _READS_THINKING.search(template) is not None


def conversation(
    messages: list[ChatMessage],
    takes_tools: bool = True,
    image_placeholder: str = "",
    video_placeholder: str = "",
    takes_thinking: bool = False,
    as_parts: bool = False,
) -> list[dict]:
    """Pydantic messages -> the dicts a chat template reads (content parts joined into one string, an
    image or video part as the model's placeholder and a newline: serving/multimodal.py; or with
    `as_parts`, --chat-template-content-format openai, a list of parts, an image or video part as
    {"type": "image"} or {"type": "video"} for the template to render; calls as `render_calls` puts
    them; an assistant's `reasoning_content` as `thinking` where the template reads that,
    `takes_thinking`, where parallel calls go back a turn each: `_one_call_a_turn`)."""
    placeholders = {"image_url": image_placeholder, "video_url": video_placeholder}
    out = []
    for message in messages:
        content = message.content
        if isinstance(content, list) and as_parts:
            content = [
                {"type": "text", "text": part.text} if part.type == "text" else {"type": _MEDIA[part.type]}
                for part in content
            ]
        elif isinstance(content, list):
            content = "".join(
                part.text if part.type == "text" else placeholders[part.type] + "\n" for part in content
            )
        # OpenAI's "developer" role is the newer name of "system"; templates know only the latter.
        entry = {"role": "system" if message.role == "developer" else message.role, "content": content or ""}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        render_calls(entry, message, takes_tools)
        if takes_thinking and message.role == "assistant" and message.reasoning_content:
            out += _with_thinking(entry, message.reasoning_content)
        else:
            out.append(entry)
    return _one_call_a_turn(out) if takes_thinking else out


def _parts(entry: dict) -> dict:
    """A message whose content is a string with it as a list of one text part (none for ""), as vLLM's
    "openai" content format gives every message."""
    content = entry["content"]
    if isinstance(content, str):
        return {**entry, "content": [{"type": "text", "text": content}] if content else []}
    return entry


def _one_call_a_turn(entries: list[dict]) -> list[dict]:
    """gpt-oss's template renders an assistant turn's first call only, and names each tool output after
    the call rendered last (harmony writes one call a message, its output right after it). So a turn of
    several calls becomes a turn per call (the thinking with the first), each followed by the tool
    outputs after the turn that answer it (`tool_call_id`); outputs answering none of them follow."""
    out, i = [], 0
    while i < len(entries):
        entry, i = entries[i], i + 1
        calls = entry.get("tool_calls") or []
        if entry["role"] != "assistant" or len(calls) < 2:
            out.append(entry)
            continue
        outputs = []
        while i < len(entries) and entries[i]["role"] == "tool":
            outputs.append(entries[i])
            i += 1
        for n, call in enumerate(calls):
            turn = {**entry, "tool_calls": [call]}
            if n:
                turn.pop("thinking", None)
                turn["content"] = ""
            out.append(turn)
            out += [o for o in outputs if o.get("tool_call_id") == call["id"]]
        ids = {call["id"] for call in calls}
        out += [o for o in outputs if o.get("tool_call_id") not in ids]
    return out


def _with_thinking(entry: dict, thought: str) -> list[dict]:
    """An assistant turn's dict with its thinking as `thinking` (gpt-oss's template shows it before a
    call no final answer follows). That template takes a call's thinking or its text (a commentary
    preamble), not both: the text then goes in a turn of its own before the call's."""
    entry = {**entry, "thinking": thought}
    if entry.get("tool_calls") and entry["content"]:
        return [{"role": "assistant", "content": entry["content"]}, {**entry, "content": ""}]
    return [entry]


def render_chat(state: ServerState, req: ChatCompletionRequest) -> str:
    """The prompt text of a chat request (`apply_chat_template` with the request's own fields)."""
    return apply_chat_template(
        state,
        req.messages,
        req.add_generation_prompt,
        req.continue_final_message,
        req.tools,
        req.template_variables,
        req.chat_template,
    )


def apply_chat_template(
    state: ServerState,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    continue_final_message: bool,
    tools: list[ChatTool] | None = None,
    chat_template_kwargs: dict | None = None,
    request_template: str | None = None,
) -> str:
    """The prompt text of `messages`, rendered with the request's own template (`request_template`:
    only on a server started with --trust-request-chat-template), else the server's --chat-template,
    else the tokenizer's."""
    tokenizer = require_tokenizer(state.engine, "the chat template", "messages")
    if request_template is not None and not state.trust_request_chat_template:
        raise bad_request(
            "chat_template: this server renders no chat template sent with a request; start it with "
            "--trust-request-chat-template to allow them",
            "chat_template",
        )
    template = request_template or state.chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise bad_request(
            "this model has no chat template; start the server with --chat-template", "messages"
        )
    if continue_final_message and (add_generation_prompt or messages[-1].role != "assistant"):
        raise bad_request(
            "continue_final_message needs the last message to be the assistant's and "
            "add_generation_prompt=false",
            "continue_final_message",
        )
    check_history(messages)
    extra = template_kwargs(chat_template_kwargs)
    takes_tools = template_takes_tools(template)
    as_parts = content_format(template, state.chat_template_content_format) == "openai"
    mm = getattr(getattr(state.engine, "input_processor", None), "mm_processor", None)  # None: text only
    chat = conversation(
        messages,
        takes_tools,
        mm.chat_placeholder if mm is not None else "",
        (mm.chat_video_placeholder or "") if mm is not None else "",
        template_takes_thinking(template),
        as_parts,
    )
    tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    if tool_dicts and not takes_tools:
        chat = tools_in_system_prompt(chat, tool_dicts)
    if as_parts:
        chat = [_parts(entry) for entry in chat]
    try:
        return tokenizer.apply_chat_template(
            chat,
            tools=tool_dicts if takes_tools else None,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **extra,
        )
    except Exception as e:  # noqa: BLE001 - the template's raise_exception(), or a template bug
        if request_template is not None and isinstance(e, TemplateSyntaxError):
            raise bad_request(f"chat_template is not a valid Jinja template: {e}", "chat_template") from None
        if type(e) is TemplateError:  # raise_exception(message): the template's words, meant for users
            raise bad_request(f"the chat template rejects these messages: {e}", "messages") from None
        logger.warning("the chat template failed: %s: %s", type(e).__name__, e)
        raise bad_request("the chat template cannot render these messages", "messages") from None
