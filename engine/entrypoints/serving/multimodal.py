"""Image and video parts of chat messages, into a vision-language prompt: loaded, checked and processed
off the event loop (a worker thread), every refusal a 400 naming the part
(`messages[0].content[1].image_url`, `messages[0].content[2].video_url`).

The chat template sees each part as the model's placeholder (chat_template.conversation); the model's
processor then expands the placeholders and makes the images' and videos' features (engine/engine/
mm_processor.py). Where an image or video may come from and how large it may be: engine/engine/media.py;
how a video is decoded and its frames sampled: engine/engine/video.py.
"""

from __future__ import annotations

import asyncio

from xlaserve.core.multimodal import MultiModalFeature
from xlaserve.engine.media import MediaError, load_image
from xlaserve.engine.video import load_video
from xlaserve.entrypoints.serving.chat_protocol import ChatMessage
from xlaserve.entrypoints.serving.errors import bad_request
from xlaserve.entrypoints.serving.state import ServerState


def media_parts(messages: list[ChatMessage], kinds: tuple[str, ...]) -> list[tuple[str, str | None]]:
    """(field, url) of every part of the `kinds` ("image_url", "video_url"), in order (url None: the part
    names media sent before by its uuid)."""
    return [
        (f"messages[{i}].content[{j}].{part.type}", getattr(getattr(part, part.type), "url", None))
        for i, message in enumerate(messages)
        if isinstance(message.content, list)
        for j, part in enumerate(message.content)
        if part.type in kinds
    ]


def media_uuids(messages: list[ChatMessage]) -> dict[str, list[str | None]]:
    """The `uuid` of every image and every video part, in order (MultiModalProcessor.process's `uuids`)."""
    parts = [part for message in messages if isinstance(message.content, list) for part in message.content]
    return {kind: [part.uuid for part in parts if part.type == f"{kind}_url"] for kind in ("image", "video")}


def image_parts(messages: list[ChatMessage]) -> list[tuple[str, str]]:
    """(field, url) of every image part, in order."""
    return media_parts(messages, ("image_url",))


def video_parts(messages: list[ChatMessage]) -> list[tuple[str, str]]:
    """(field, url) of every video part, in order."""
    return media_parts(messages, ("video_url",))


def check_parts(state: ServerState, parts: list[tuple[str, str]], kind: str) -> None:
    """400 naming the first `kind` ("image" or "video") part a model without them (text only; for a
    video, images only) refuses, or the first past the per-prompt limit."""
    if not parts:
        return
    mm = state.engine.input_processor.mm_processor
    field = parts[0][0]
    if mm is None:
        raise bad_request(f"{field}: this model takes text only: {kind} parts are not supported", field)
    if kind == "video" and mm.video_placeholder is None:
        raise bad_request(f"{field}: this model takes images, not videos", field)
    limit = mm.max_images if kind == "image" else mm.max_videos
    if len(parts) > limit:
        field = parts[limit][0]
        raise bad_request(
            f"{field}: {len(parts)} {kind}s in one request; at most {limit} (--limit-mm-per-prompt)", field
        )


async def load_media(
    state: ServerState, image_parts: list[tuple[str, str]], video_parts: list[tuple[str, str]]
) -> tuple[list, list]:
    """The parts' images and videos, every part checked before any is read (`check_parts`)."""
    check_parts(state, image_parts, "image")
    check_parts(state, video_parts, "video")
    images = await load_images(state, image_parts) if image_parts else []
    videos = await load_videos(state, video_parts) if video_parts else []
    return images, videos


async def load_images(state: ServerState, parts: list[tuple[str, str]]) -> list:
    """The parts' images, loaded and decoded in a worker thread; a 400 naming a part that fails."""
    return await _load(state, parts, load_image)


async def load_videos(state: ServerState, parts: list[tuple[str, str]]) -> list:
    """The parts' videos as (frames, metadata), loaded, decoded and sampled in a worker thread; a 400
    naming a part that fails (a server without PyAV: one saying to install the video extra)."""
    return await _load(state, parts, load_video)


async def _load(state: ServerState, parts: list[tuple[str, str]], load) -> list:
    def load_all():  # a part without a URL names media sent before: MultiModalProcessor resolves it
        return [None if url is None else load(url, state.media_policy, field) for field, url in parts]

    try:
        return await asyncio.to_thread(load_all)
    except MediaError as e:
        raise bad_request(str(e), e.field) from None


async def process_images(
    state: ServerState,
    text: str,
    images: list,
    videos: list = (),
    video_fields: list[str] | None = None,
    mm_processor_kwargs: dict | None = None,
    **named,
) -> tuple[list[int], list[MultiModalFeature]]:
    """The rendered prompt's ids with the placeholders expanded, and the images' and videos' features
    (`video_fields`: each video's part, named by its errors; `mm_processor_kwargs`: the request's processor
    settings; `named`: `image_fields` and `uuids`, MultiModalProcessor.process's), in a thread: resizing and
    normalizing is numpy work."""
    mm = state.engine.input_processor.mm_processor
    kwargs = {"add_special_tokens": False, "field": "messages", "video_fields": video_fields}
    kwargs |= {"mm_processor_kwargs": mm_processor_kwargs, **named}
    try:
        return await asyncio.to_thread(mm.process, text, images, list(videos), **kwargs)
    except MediaError as e:
        raise bad_request(str(e), e.field) from None
    except ValueError as e:
        raise bad_request(str(e), "messages") from None


def check_mm_processor_kwargs(state: ServerState, kwargs: dict | None) -> None:
    """A 400 naming what a request's mm_processor_kwargs hold that its model's processor refuses (checked
    with no media too, so a request's errors do not hang on its parts). None asks nothing of the engine:
    one without an input processor (--skip-tokenizer-init) refuses the route for what it lacks instead."""
    if not kwargs:
        return
    try:
        state.engine.input_processor.check_mm_processor_kwargs(kwargs)
    except MediaError as e:
        raise bad_request(str(e), e.field) from None
