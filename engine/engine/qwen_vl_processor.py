"""The Qwen VL families' processor (Qwen2.5-VL, Qwen3-VL, Qwen3.5): images at their own sizes, each
`<|image_pad|>` expanded to its grid's tokens, and videos: frames paired along time, Qwen2.5-VL's
seconds a pair, Qwen3-VL's each pair's time in the text. Hugging Face's own processors need torchvision
for videos, so this one stands in for them behind engine/engine/mm_processor.py. No jax.
"""

from __future__ import annotations

import math

import numpy as np

from xlaserve.engine.media import MediaError
from xlaserve.models.processor_settings import (
    image_processor_kwargs,
    max_image_tokens,
    pixel_bounds,
    video_fps,
)

# The families whose videos are Qwen3VLProcessor's: each frame pair's time in the text.
_TIMED_VIDEOS = (
    "Qwen3VLForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
)


# What a request's mm_processor_kwargs may set (vLLM hands them to Hugging Face's processor): an image's
# pixel bounds, and the rate of a video's frames where the video states none (the directory's `fps`).
REQUEST_KWARGS = ("min_pixels", "max_pixels", "fps")


class QwenVLProcessor:
    """The Qwen VL families' processor: Hugging Face's image processor (Qwen2VLImageProcessorPil: each
    image resized to a multiple of patch x merge pixels within min/max pixels, cut into patches), and
    each `<|image_pad|>` of the text expanded to the image's tokens (grid patches / merge_size^2), as
    Qwen2_5_VLProcessor does (which cannot be built here: its video processor needs torchvision).

    Videos (`fps` given): each frame through the same image processor (so a video takes the image
    settings' min/max pixels), then frames paired along time as the video processor does (the last
    repeated to an even count): a video of F frames is a (F / 2, h, w) grid of the frames' patches.
    Qwen2.5-VL: its `<|video_pad|>` expands to all their tokens; `second_per_grid_ts` is 2 / fps (a
    video's own fps where given, else the directory's). Qwen3-VL (`timestamps`): as Qwen3VLProcessor,
    to each pair's time (at the same fps) in the text and then its tokens in vision marks,
    `<0.2 seconds><|vision_start|><|video_pad|>...<|vision_end|>` a pair (the prompt's own marks around
    the placeholder stay: Hugging Face replaces the `<|video_pad|>` only)."""

    image_token = "<|image_pad|>"
    chat_placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    chat_video_placeholder = "<|vision_start|><|video_pad|><|vision_end|>"

    def __init__(self, image_processor, tokenizer, fps: float | None = None, timestamps: bool = False):
        self.image_processor, self.tokenizer = image_processor, tokenizer
        self.merge_unit = image_processor.merge_size**2
        self.fps = fps
        self.video_token = "<|video_pad|>" if fps is not None else None
        self.timestamps = timestamps

    def __call__(
        self,
        text: str,
        images=None,
        videos=None,
        return_tensors: str = "np",
        add_special_tokens: bool = True,
        fps: list[float | None] | None = None,
    ):
        out = {}
        if images:
            out |= self.image_processor(images=images, return_tensors="np")
            text = self._expand(text, self.image_token, out["image_grid_thw"])
        if videos:
            fps = fps or [None] * len(videos)
            out |= self._videos(videos, fps)
            if self.timestamps:
                num_frames = [len(frames) for frames in videos]
                text = self._expand_timed(text, out["video_grid_thw"], num_frames, fps)
            else:
                text = self._expand(text, self.video_token, out["video_grid_thw"])
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        return {**out, "input_ids": np.asarray([ids], np.int64)}

    def _expand(self, text: str, placeholder: str, grids) -> str:
        pieces = text.split(placeholder)
        counts = [int(np.prod(grid)) // self.merge_unit for grid in grids]
        return pieces[0] + "".join(placeholder * n + piece for n, piece in zip(counts, pieces[1:]))

    def _expand_timed(self, text: str, grids, num_frames: list[int], fps: list[float | None]) -> str:
        """Each `<|video_pad|>` as Qwen3VLProcessor's `replace_video_token`: per frame pair its time (the
        mean of its two frames' at the video's fps, else the directory's; the last frame repeated to fill
        the pair) to one decimal, then its tokens between vision marks."""
        pieces = text.split(self.video_token)
        pairs = self.image_processor.temporal_patch_size
        out = pieces[0]
        for (t, h, w), frames, rate, piece in zip(grids, num_frames, fps, pieces[1:]):
            rate = rate or self.fps
            index = np.minimum(np.arange(t * pairs), frames - 1).reshape(t, pairs)
            times = (index[:, 0] / rate + index[:, -1] / rate) / 2  # in Hugging Face's order
            frame = "<|vision_start|>" + self.video_token * (int(h * w) // self.merge_unit) + "<|vision_end|>"
            out += "".join(f"<{time:.1f} seconds>{frame}" for time in times) + piece
        return out

    def _videos(self, videos: list, fps: list[float | None]) -> dict[str, np.ndarray]:
        pairs = self.image_processor.temporal_patch_size
        values, grids = [], []
        for frames in videos:
            frames = list(frames) + [frames[-1]] * (-len(frames) % pairs)  # the last repeated
            out = self.image_processor(images=frames, return_tensors="np")
            (_, h, w), channels = out["image_grid_thw"][0], self.image_processor.patch_size
            # Each frame's patches hold it `pairs` times over ([P, C, T, p, p]): keep one, then pair.
            per_frame = out["pixel_values"].reshape(len(frames), h * w, 3, pairs, channels, channels)[
                :, :, :, 0
            ]
            grouped = per_frame.reshape(len(frames) // pairs, pairs, h * w, 3, channels, channels)
            values.append(grouped.transpose(0, 2, 3, 1, 4, 5).reshape(len(frames) // pairs * h * w, -1))
            grids.append((len(frames) // pairs, h, w))
        out = {"pixel_values_videos": np.concatenate(values), "video_grid_thw": np.asarray(grids, np.int64)}
        if not self.timestamps:  # Qwen2.5-VL's temporal positions: seconds a pair
            out["second_per_grid_ts"] = np.asarray([pairs / (f or self.fps) for f in fps], np.float32)
        return out


def qwen_vl_processor(settings: dict, hf_config: dict, tokenizer):
    """The Qwen VL families': images keep their sizes, so the tokens per image given is the most one
    has; videos' frames are taken at the settings' `fps` (2 by default), Qwen3-VL's pairs with their
    times in the text."""
    from transformers import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil(
        **{k: v for k, v in image_processor_kwargs(settings).items() if k != "fps"}
    )
    timestamps = hf_config["architectures"][0] in _TIMED_VIDEOS
    processor = QwenVLProcessor(image_processor, tokenizer, video_fps(settings), timestamps)
    return processor, max_image_tokens(settings, hf_config["vision_config"])


def check_request_kwargs(kwargs: dict, settings: dict, field: str) -> None:
    """A request's mm_processor_kwargs (`field`) for the Qwen VL families, against the server's processor
    `settings`: positive integer `min_pixels` and `max_pixels`, max_pixels within the server's (an
    encoder-cache slot holds one image of it) and min_pixels within it; `fps` a number > 0. Anything
    else is a MediaError naming the key."""
    for key, value in kwargs.items():
        name = f"{field}.{key}"
        if key not in REQUEST_KWARGS:
            raise MediaError(
                f"not a per-request setting of this model's processor; it takes {list(REQUEST_KWARGS)}", name
            )
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if key == "fps" and not (is_number and 0 < value < math.inf):
            raise MediaError(f"must be a number of frames a second > 0, got {value!r}", name)
        if key != "fps" and not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise MediaError(f"must be a positive integer (pixels), got {value!r}", name)
    server_min, server_max = pixel_bounds(settings)
    max_pixels = kwargs.get("max_pixels", server_max)
    if max_pixels > server_max:
        raise MediaError(
            f"at most {server_max}, the server's max_pixels (an encoder-cache slot holds one such image), "
            f"got {max_pixels}",
            f"{field}.max_pixels",
        )
    min_pixels = kwargs.get("min_pixels", server_min)
    if min_pixels > max_pixels:
        raise MediaError(f"{min_pixels} is more than max_pixels ({max_pixels})", f"{field}.min_pixels")
