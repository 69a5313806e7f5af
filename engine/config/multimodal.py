"""The media a prompt may carry: --limit-mm-per-prompt (images and videos per prompt, and vLLM's object
form of a modality's limit) and --media-io-kwargs (how a video is read). ModelConfig keeps both flags as
JSON text, checked here when it is built; the front end reads the parsed values."""

from __future__ import annotations

import json

# Images and videos per prompt when --limit-mm-per-prompt does not say (vLLM's flag; '{"image": 2}').
DEFAULT_IMAGES_PER_PROMPT = 8
DEFAULT_VIDEOS_PER_PROMPT = 1


DEFAULT_VIDEO_NUM_FRAMES = 32  # vLLM's


def video_num_frames_of(media_io_kwargs: dict) -> int:
    """--media-io-kwargs' video.num_frames (DEFAULT_VIDEO_NUM_FRAMES when unset); ValueError naming the
    field for anything but an integer >= 1 or -1, or keys it does not know."""
    unknown = sorted(set(media_io_kwargs) - {"video"})
    if unknown:
        raise ValueError(f"media_io_kwargs: modalities {unknown} are not supported; supported: ['video']")
    video = media_io_kwargs.get("video", {})
    if not isinstance(video, dict) or set(video) - {"num_frames"}:
        raise ValueError(f'media_io_kwargs.video must be like {{"num_frames": 32}}, got {video!r}')
    count = video.get("num_frames", DEFAULT_VIDEO_NUM_FRAMES)
    if not isinstance(count, int) or isinstance(count, bool) or not (count >= 1 or count == -1):
        raise ValueError(f"media_io_kwargs.video.num_frames must be an integer >= 1 or -1, got {count!r}")
    return count


def parse_mm_limits(value) -> dict[str, int]:
    """--limit-mm-per-prompt's JSON text (or a dict) -> {"image": n, "video": m}; ValueError naming the
    field."""
    defaults = {"image": DEFAULT_IMAGES_PER_PROMPT, "video": DEFAULT_VIDEOS_PER_PROMPT}
    if value is None:
        return defaults
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f'limit_mm_per_prompt must be JSON like {{"image": 2}}, got {value!r}') from None
    if not isinstance(value, dict):
        raise ValueError(f'limit_mm_per_prompt must be an object like {{"image": 2}}, got {value!r}')
    unknown = sorted(set(value) - set(defaults))
    if unknown:
        raise ValueError(
            f"limit_mm_per_prompt: modalities {unknown} are not supported; supported: {sorted(defaults)}"
        )
    limits = {**defaults, **value}
    for modality, count in limits.items():
        if isinstance(count, dict):
            count = limits[modality] = _mm_limit_options(modality, count, defaults[modality])
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"limit_mm_per_prompt.{modality} must be an integer >= 0, got {count!r}")
    return limits


# vLLM's object form of a modality's limit: its count, and the sizes its memory profiling's dummy inputs
# take. No dummy inputs here (the KV budget is set without them), so the sizes are checked and unused.
_MM_LIMIT_SIZES = {"image": ("width", "height"), "video": ("num_frames", "width", "height")}


def _mm_limit_options(modality: str, options: dict, default: int):
    """{"count": n, "width": w, ...} -> n (`default` when absent); ValueError naming a bad entry."""
    for key, value in options.items():
        field = f"limit_mm_per_prompt.{modality}.{key}"
        if key != "count" and key not in _MM_LIMIT_SIZES[modality]:
            raise ValueError(f"{field} is not an option; options: {['count', *_MM_LIMIT_SIZES[modality]]}")
        if key != "count" and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ValueError(f"{field} must be an integer > 0, got {value!r}")
    return options.get("count", default)
