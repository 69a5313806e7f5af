"""Image parts of chat messages, into a vision-language prompt: loaded, checked and processed off the
event loop (a worker thread), every refusal a 400 naming the part (`messages[0].content[1].image_url`).

The chat template sees each image part as the model's placeholder (chat_template.conversation); the
model's processor then expands the placeholders and makes the images' features (engine/engine/
mm_processor.py). Where an image may come from and how large it may be: engine/engine/media.py.
"""

from __future__ import annotations

import asyncio

from xlaserve.core.multimodal import MultiModalFeature
from xlaserve.engine.media import MediaError, load_image
from xlaserve.entrypoints.serving.errors import bad_request
from xlaserve.entrypoints.serving.protocol import ChatMessage
from xlaserve.entrypoints.serving.state import ServerState


def image_parts(messages: list[ChatMessage]) -> list[tuple[str, str]]:
    """(field, url) of every image part, in order."""
    return [
        (f"messages[{i}].content[{j}].image_url", part.image_url.url)
        for i, message in enumerate(messages)
        if isinstance(message.content, list)
        for j, part in enumerate(message.content)
        if part.type == "image_url"
    ]


def check_image_parts(state: ServerState, parts: list[tuple[str, str]]) -> None:
    """400 naming the first part a text-only model, or the per-prompt limit, refuses."""
    if not parts:
        return
    mm = state.engine.input_processor.mm_processor
    if mm is None:
        raise bad_request(
            f"{parts[0][0]}: this model takes text only: image parts are not supported", parts[0][0]
        )
    if len(parts) > mm.max_images:
        field = parts[mm.max_images][0]
        raise bad_request(
            f"{field}: {len(parts)} images in one request; at most {mm.max_images} (--limit-mm-per-prompt)",
            field,
        )


async def load_images(state: ServerState, parts: list[tuple[str, str]]) -> list:
    """The parts' images, loaded and decoded in a worker thread; a 400 naming a part that fails."""

    def load_all():
        return [load_image(url, state.media_policy, field) for field, url in parts]

    try:
        return await asyncio.to_thread(load_all)
    except MediaError as e:
        raise bad_request(str(e), e.field) from None


async def process_images(
    state: ServerState, text: str, images: list
) -> tuple[list[int], list[MultiModalFeature]]:
    """The rendered prompt's ids with the placeholders expanded, and the images' features (in a thread:
    resizing and normalizing is numpy work)."""
    mm = state.engine.input_processor.mm_processor
    try:
        return await asyncio.to_thread(mm.process, text, images, add_special_tokens=False, field="messages")
    except MediaError as e:
        raise bad_request(str(e), e.field) from None
    except ValueError as e:
        raise bad_request(str(e), "messages") from None
