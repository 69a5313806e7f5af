"""What a vision-language model directory's processor settings (preprocessor_config.json) say that both
sides need: the front end to process images and videos, the engine to size its encoder cache and place
a video's frames in time. Plain Python (the front end imports it: no jax)."""

from __future__ import annotations

import json
import os

DEFAULT_MAX_PIXELS = 12845056  # Qwen2-VL's image processor's default (16,384 tokens of 28 x 28 pixels)
DEFAULT_VIDEO_FPS = 2.0


def read_settings(model_dir: str) -> dict:
    """A model directory's processor settings: preprocessor_config.json, then processor_config.json
    over it ({} when it has neither)."""
    settings = {}
    for name in ("preprocessor_config.json", "processor_config.json"):
        path = os.path.join(model_dir, name)
        if os.path.exists(path):
            with open(path) as f:
                settings |= json.load(f)
    return settings


def with_overrides(settings: dict, overrides: dict) -> dict:
    """`settings` with `overrides` (--mm-processor-kwargs) over its image processor's part."""
    if not overrides:
        return settings
    if "image_processor" in settings:
        return {**settings, "image_processor": {**settings["image_processor"], **overrides}}
    return {**settings, **overrides}


def image_settings(settings: dict) -> dict:
    """The image processor's part of the settings (processor_config.json nests it)."""
    return settings.get("image_processor") or settings


# Keys of the settings that name the processor rather than configure it.
_NOT_ARGUMENTS = (
    "image_processor_type",
    "processor_class",
    "_processor_class",
    "auto_map",
    "image_processor",
)


def image_processor_kwargs(settings: dict) -> dict:
    """The image processor's constructor arguments of the settings."""
    return {k: v for k, v in image_settings(settings).items() if k not in _NOT_ARGUMENTS}


def pixel_bounds(settings: dict) -> tuple[int, int]:
    """(min_pixels, max_pixels) of the Qwen families' image processor (transformers 5 spells them
    size.shortest_edge and size.longest_edge; the min 0 where the settings state none)."""
    settings = image_settings(settings)
    size = settings.get("size") or {}
    min_pixels = settings.get("min_pixels") or size.get("shortest_edge") or 0
    max_pixels = settings.get("max_pixels") or size.get("longest_edge") or DEFAULT_MAX_PIXELS
    return int(min_pixels), int(max_pixels)


def max_image_tokens(settings: dict, vision: dict) -> int:
    """Tokens of the largest image the Qwen families' processor makes: its max_pixels over the pixels of
    one token (`vision`: config.json's vision_config)."""
    max_pixels = pixel_bounds(settings)[1]
    return max_pixels // (vision.get("patch_size", 14) * vision.get("spatial_merge_size", 2)) ** 2


def video_fps(settings: dict) -> float:
    """The frames per second a video's frames are taken as (the settings' `fps`; 2)."""
    return float(image_settings(settings).get("fps") or DEFAULT_VIDEO_FPS)
