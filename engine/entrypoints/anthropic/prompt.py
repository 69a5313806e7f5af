"""An Anthropic request's prompt on the chat path: the chat request's tool plan, the rendered template,
its ids and its images' features."""

from __future__ import annotations

from xlaserve.entrypoints.anthropic.convert import image_fields
from xlaserve.entrypoints.anthropic.protocol import CountTokensRequest
from xlaserve.entrypoints.serving.chat_protocol import ChatCompletionRequest
from xlaserve.entrypoints.serving.chat_template import render_chat
from xlaserve.entrypoints.serving.engine_io import tokenize_text
from xlaserve.entrypoints.serving.multimodal import (
    check_parts,
    image_parts,
    load_images,
    process_images,
)
from xlaserve.entrypoints.serving.state import ServerState
from xlaserve.entrypoints.serving.tools import ToolPlan, plan_tools


async def render(
    state: ServerState, req: CountTokensRequest, chat: ChatCompletionRequest
) -> tuple[ChatCompletionRequest, ToolPlan, str, list[int], list]:
    """`req` as the chat request `chat` (convert.py's; an MCP answer's later turn has more messages): it,
    its tool plan, the rendered prompt, its ids and its images' features (a vision-language model:
    serving/multimodal.py, 400s naming the block)."""
    plan = plan_tools(chat, state.enable_auto_tool_choice)
    parts = [(field, url) for (_, url), field in zip(image_parts(chat.messages), image_fields(req))]
    check_parts(state, parts, "image")
    images = await load_images(state, parts) if parts else []
    text = render_chat(state, chat)
    if images:
        return chat, plan, text, *(await process_images(state, text, images))
    return chat, plan, text, tokenize_text(state.engine, text, False, "messages"), []
