"""A vision-language model's inputs, made in the front end with the model's own Hugging Face processor.

The prompt's text holds one image placeholder (`<image>` for LLaVA) per image; the processor expands
each into the model's `tokens_per_image` image tokens and turns the images into pixel values. Each image
becomes a `MultiModalFeature` (core/multimodal.py): where its tokens sit, its pixels and their content
hash. Chat messages' content parts are flattened to text with a placeholder where each image (or video)
was (`flatten_content`), so any chat template renders them. No jax; the engine core's step never decodes.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from collections.abc import Callable

import numpy as np
from jinja2 import TemplateSyntaxError, nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from PIL import Image

from xlaserve.config import parse_mm_limits
from xlaserve.core.multimodal import MultiModalFeature, hash_pixels
from xlaserve.engine.media import MediaError, check_image
from xlaserve.engine.media_uuids import MediaByUUID
from xlaserve.engine.qwen_vl_processor import check_request_kwargs, qwen_vl_processor
from xlaserve.models.processor_settings import image_processor_kwargs, read_settings, with_overrides

_ENV = ImmutableSandboxedEnvironment()  # parses templates for content_format; renders none


class MultiModalProcessor:
    def __init__(
        self,
        hf_processor,
        image_token_id: int,
        tokens_per_image: int,
        max_images: int,
        video_token_id: int | None = None,
        max_videos: int = 0,
        build: Callable[[dict], object] | None = None,
        check_kwargs: Callable[[dict, str], None] | None = None,
    ):
        self.hf_processor = hf_processor
        # A request's mm_processor_kwargs: `check_kwargs(kwargs, field)` refuses what the family does not
        # take, `build(kwargs)` makes the processor of the server's settings with them over (None: the
        # family takes none per request).
        self._build, self._check_kwargs = build, check_kwargs
        # The processors built for requests' kwargs, by their items (a route checks a request's kwargs
        # before it processes its media: one build serves both, and every later request of those kwargs).
        self._built = functools.lru_cache(maxsize=16)(lambda items: self._build(dict(items)))
        self.media_by_uuid = MediaByUUID()
        self.placeholder = hf_processor.image_token  # the text standing for one image, e.g. "<image>"
        # What a chat message's image part becomes (Qwen2.5-VL wraps its placeholder in vision marks).
        self.chat_placeholder = getattr(hf_processor, "chat_placeholder", self.placeholder)
        self.image_token_id = image_token_id
        self.tokens_per_image = tokens_per_image
        self.max_images = max_images
        # Videos (Qwen2.5-VL's frames): the processor's `video_token`, or None for a model of images only.
        self.video_placeholder = getattr(hf_processor, "video_token", None)
        self.chat_video_placeholder = (
            getattr(hf_processor, "chat_video_placeholder", None) if self.video_placeholder else None
        )
        self.video_token_id = video_token_id
        self.max_videos = max_videos

    @classmethod
    def for_model(
        cls, model: str | None, tokenizer, limit_mm_per_prompt=None, mm_processor_kwargs: dict | None = None
    ) -> MultiModalProcessor | None:
        """The processor of a vision-language model's directory (its settings under
        `mm_processor_kwargs`); None for a text-only model (or a .gguf file, the embedded model, no
        tokenizer)."""
        model_dir = os.path.expanduser(model) if model else None
        config_path = (
            os.path.join(model_dir, "config.json") if model_dir and os.path.isdir(model_dir) else None
        )
        if config_path is None or not os.path.exists(config_path) or tokenizer is None:
            return None
        with open(config_path) as f:
            hf_config = json.load(f)
        family = VISION_LANGUAGE_FAMILIES.get((hf_config.get("architectures") or [""])[0])
        if family is None:
            return None
        settings = with_overrides(read_settings(model_dir), mm_processor_kwargs or {})
        processor, num_tokens = family(settings, hf_config, tokenizer)
        image_token_id = hf_config.get("image_token_index", hf_config.get("image_token_id"))
        limits = parse_mm_limits(limit_mm_per_prompt)
        check = REQUEST_KWARG_CHECKS.get(family)
        return cls(
            processor,
            image_token_id,
            num_tokens,
            limits["image"],
            hf_config.get("video_token_id"),
            limits["video"],
            # A copy: Hugging Face's image processors write max_pixels into the `size` dict they are given.
            build=lambda kwargs: family(
                with_overrides(copy.deepcopy(settings), kwargs), hf_config, tokenizer
            )[0],
            check_kwargs=check and (lambda kwargs, field: check(kwargs, settings, field)),
        )

    def processor_for(self, mm_processor_kwargs: dict | None, field: str = "mm_processor_kwargs"):
        """The Hugging Face processor of a request's `mm_processor_kwargs` (vLLM's per-request ones: the
        server's --mm-processor-kwargs with them over, for this request alone; `field` names them in
        errors); the server's own where there are none."""
        if not mm_processor_kwargs:
            return self.hf_processor
        if not isinstance(mm_processor_kwargs, dict):
            raise MediaError("must be an object of the processor's settings", field)
        if self._check_kwargs is None:
            raise MediaError(
                "this model's processor takes no per-request settings",
                f"{field}.{next(iter(mm_processor_kwargs))}",
            )
        self._check_kwargs(mm_processor_kwargs, field)
        return self._built(tuple(sorted(mm_processor_kwargs.items())))

    def process(
        self,
        text: str,
        images: list,
        videos: list = (),
        *,
        add_special_tokens: bool = True,
        field: str = "multi_modal_data.image",
        video_fields: list[str] | None = None,
        mm_processor_kwargs: dict | None = None,
        kwargs_field: str = "mm_processor_kwargs",
        image_fields: list[str] | None = None,
        uuids: dict[str, list] | None = None,
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """(the prompt's ids with each placeholder expanded, one feature per image and video, in prompt
        order). A video is a list of frames (PIL images or one uint8 array [T, H, W, 3]), or vLLM's
        (frames, metadata) pair whose metadata's `fps` is the frames' rate (else the directory's fps).
        `video_fields` name each video in errors (a chat's video parts; else `...video[i]`).
        `mm_processor_kwargs`: the request's settings over the server's (`processor_for`); a feature's
        hash is of the pixels they made, so requests of other settings never share its encoding.
        `uuids` ({"image": [...], "video": [...]}, vLLM's multi_modal_uuids): an item None is the media
        last sent under its uuid (engine/engine/media_uuids.py); `image_fields` name each image in errors."""
        hf_processor = self.processor_for(mm_processor_kwargs, kwargs_field)
        if len(images) > self.max_images:
            raise ValueError(
                f"{field}: {len(images)} images in one prompt; at most {self.max_images} "
                "(--limit-mm-per-prompt)"
            )
        video_field = field.rsplit(".", 1)[0] + ".video"
        if videos and self.video_placeholder is None:
            raise ValueError(f"{video_field}: this model takes images, not videos")
        if len(videos) > self.max_videos:
            raise ValueError(
                f"{video_field}: {len(videos)} videos in one prompt; at most {self.max_videos} "
                "(--limit-mm-per-prompt)"
            )
        image_fields = image_fields or [f"{field}[{i}]" for i in range(len(images))]
        video_fields = video_fields or [f"{video_field}[{i}]" for i in range(len(videos))]
        uuids = uuids or {}
        images = self.media_by_uuid.resolve(list(images), uuids.get("image"), "image", image_fields)
        videos = self.media_by_uuid.resolve(list(videos), uuids.get("video"), "video", video_fields)
        images = [check_image(_as_pil(image, name), name) for image, name in zip(images, image_fields)]
        pairs = [_video(video, name) for video, name in zip(videos, video_fields)]
        videos, fps = [frames for frames, _ in pairs], [rate for _, rate in pairs]
        for placeholder, items, name, where in (
            (self.placeholder, images, "images", field),
            (self.video_placeholder, videos, "videos", video_field),
        ):
            num_placeholders = text.count(placeholder) if placeholder else 0
            if num_placeholders != len(items):
                raise ValueError(
                    f"{where}: the prompt has {num_placeholders} {placeholder} placeholders for "
                    f"{len(items)} {name}"
                )
        kwargs = {"videos": videos, "fps": fps} if videos else {}
        out = hf_processor(
            text=text,
            images=images or None,
            return_tensors="np",
            add_special_tokens=add_special_tokens,
            **kwargs,
        )
        ids = out["input_ids"][0].astype(np.int64)
        features = self._features(ids, out, "image", [f"{field}[{i}]" for i in range(len(images))], field)
        if videos:
            features += self._features(ids, out, "video", video_fields, video_field)
        return ids.tolist(), sorted(features, key=lambda f: f.offset)

    def _features(
        self, ids: np.ndarray, out, modality: str, names: list[str], field: str
    ) -> list[MultiModalFeature]:
        """One feature per image (or video) of the processor's output `out`, where its tokens are;
        `names` name each in errors."""
        count = len(names)
        token_id = self.image_token_id if modality == "image" else self.video_token_id
        values = out.get("pixel_values" if modality == "image" else "pixel_values_videos")
        grids = out.get("image_grid_thw" if modality == "image" else "video_grid_thw")
        if grids is None:  # one size for every image: a fixed count of tokens
            counts = [self.tokens_per_image] * count
            pixels = [np.asarray(values[i], np.float32) for i in range(count)]  # [C, H, W]
        else:  # their own sizes (the Qwen families): patches per grid, a token per merge unit
            grids = [tuple(int(x) for x in g) for g in grids]
            if modality == "video" and getattr(self.hf_processor, "timestamps", False):
                # Qwen3-VL: each frame pair's tokens sit apart (its time's text between), so each pair is
                # a feature of its own: the tower encodes a pair alone anyway (Hugging Face's cu_seqlens).
                names = [name for (t, _, _), name in zip(grids, names) for _ in range(t)]
                grids = [(1, h, w) for t, h, w in grids for _ in range(t)]
            counts = [int(np.prod(g)) // self.hf_processor.merge_unit for g in grids]
            ends = np.cumsum([int(np.prod(g)) for g in grids])
            pixels = np.split(np.asarray(values, np.float32), ends[:-1])  # [P, K] each
        positions = np.flatnonzero(ids == token_id)
        if len(positions) != sum(counts):  # the text itself spelled the placeholder token
            raise ValueError(f"{field}: the prompt's text holds {modality} tokens of its own")
        seconds = out.get("second_per_grid_ts") if modality == "video" else None
        features, first = [], 0
        for i, n in enumerate(counts):
            if n > self.tokens_per_image:  # an encoder-cache slot holds one largest image
                raise MediaError(
                    f"{n} tokens; a {modality} may have at most {self.tokens_per_image} "
                    "(the processor's max_pixels)",
                    names[i],
                )
            offset = int(positions[first])
            if positions[first + n - 1] != offset + n - 1:
                raise ValueError(f"{field}: {modality} {i}'s tokens are not contiguous")
            grid = None if grids is None else grids[i]
            timing = None if seconds is None else float(seconds[i])
            mm_hash = hash_pixels(pixels[i], timing)
            features.append(MultiModalFeature(modality, mm_hash, offset, n, pixels[i], grid, timing))
            first += n
        return features


def as_videos(value) -> list:
    """multi_modal_data's "video" as a list of videos: one video (a uint8 array [T, H, W, 3], a list
    of frames: PIL images or [H, W, 3] arrays, or a (frames, metadata) pair) or a list of them."""
    if isinstance(value, np.ndarray) or _is_pair(value):
        return [value]
    value = list(value)
    first = value[0] if value else None
    if isinstance(first, Image.Image) or (isinstance(first, np.ndarray) and first.ndim == 3):
        return [value]  # one video's frames
    return value


def _is_pair(value) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict)


def _video(video, field: str) -> tuple[list, float | None]:
    """(a video's frames as PIL images, their fps: a (frames, metadata) pair's `fps`, else None)."""
    if not _is_pair(video):
        return _frames(video, field), None
    frames, metadata = video
    fps = metadata.get("fps")
    if fps is not None and not (isinstance(fps, (int, float)) and 0 < fps < float("inf")):
        raise MediaError(f"a video's metadata fps must be a positive number, got {fps!r}", field)
    return _frames(frames, field), fps


def _frames(video, field: str) -> list:
    """A video's frames as PIL images: a list of PIL images or uint8 [H, W, 3] arrays, or one uint8 array
    [T, H, W, 3]; every frame checked as an image is."""
    if isinstance(video, np.ndarray) and video.ndim == 4:
        video = list(video)
    if not isinstance(video, (list, tuple)) or not video:
        raise MediaError("a video must be a non-empty list of frames or a uint8 array [T, H, W, 3]", field)
    frames = [check_image(_as_pil(frame, f"{field}[{t}]"), f"{field}[{t}]") for t, frame in enumerate(video)]
    if len({frame.size for frame in frames}) > 1:
        raise MediaError(
            f"a video's frames must share one size, got {sorted({f.size for f in frames})}", field
        )
    return frames


def _as_pil(image, field: str):
    if isinstance(image, Image.Image):
        return image
    if isinstance(image, np.ndarray) and image.ndim == 3 and image.dtype == np.uint8:
        return Image.fromarray(image)
    raise MediaError("an image must be a PIL.Image or a uint8 numpy array [H, W, C]", field)


def _gemma3_processor(settings: dict, hf_config: dict, tokenizer):
    """Gemma3Processor over its Pillow image processor, without pan-and-scan crops (one image, one
    square of `mm_tokens_per_image` tokens)."""
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor

    num_tokens = hf_config.get("mm_tokens_per_image", 256)
    image_settings = {
        k: v for k, v in image_processor_kwargs(settings).items() if not k.startswith("pan_and_scan")
    }
    image_processor = Gemma3ImageProcessorPil(**{**image_settings, "do_pan_and_scan": False})
    processor = Gemma3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_length=num_tokens
    )
    return processor, num_tokens


def _llava_processor(settings: dict, hf_config: dict, tokenizer):
    """LlavaProcessor over a Pillow image processor (transformers' torchvision one is not used); an image
    is one token per patch (and the class token's under the `full` feature strategy)."""
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    image_processor = CLIPImageProcessorPil(**image_processor_kwargs(settings))
    kwargs = {
        k: settings[k]
        for k in (
            "patch_size",
            "vision_feature_select_strategy",
            "num_additional_image_tokens",
            "image_token",
        )
        if k in settings
    }
    vision = hf_config["vision_config"]
    num_patches = (vision["image_size"] // vision["patch_size"]) ** 2
    keeps_cls = hf_config.get("vision_feature_select_strategy", "default") == "full"
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, **kwargs)
    return processor, num_patches + int(keeps_cls)


# The registry's vision-language architectures: (processor settings, config.json, tokenizer) -> (the HF
# processor, tokens per image: the most one image has).
VISION_LANGUAGE_FAMILIES = {
    "LlavaForConditionalGeneration": _llava_processor,
    "Gemma3ForConditionalGeneration": _gemma3_processor,
    "Qwen2_5_VLForConditionalGeneration": qwen_vl_processor,
    "Qwen3VLForConditionalGeneration": qwen_vl_processor,
    "Qwen3_5ForConditionalGeneration": qwen_vl_processor,
    "Qwen3_5MoeForConditionalGeneration": qwen_vl_processor,
    "Qwen3VLMoeForConditionalGeneration": qwen_vl_processor,
}
# The families whose processor takes a request's own mm_processor_kwargs: (kwargs, the server's
# settings, field) -> None, a MediaError naming what it refuses. The others take none.
REQUEST_KWARG_CHECKS = {qwen_vl_processor: check_request_kwargs}


def flatten_content(
    messages: list[dict],
    placeholder: str | None,
    load: Callable[[str, str], object],
    field: str = "messages",
    video_placeholder: str | None = None,
    load_video: Callable[[str, str], object] | None = None,
    as_parts: bool = False,
) -> tuple[list[dict], list, list]:
    """OpenAI chat messages whose content may be a list of parts -> (messages with text content, images,
    videos).

    Text parts are joined; each `image_url` part becomes `placeholder` + a newline, and `load(url,
    part_field)` its image; each `video_url` part `video_placeholder` + a newline, and `load_video(url,
    part_field)` its video. `placeholder` None (a text-only model), or `video_placeholder` None for a
    video part (a model of images only): a ValueError naming the part. With `as_parts` (the "openai"
    content format: `content_format`) every message's content is a list of parts instead, text parts
    as {"type": "text", "text": ...} and a media part as {"type": "image"} or {"type": "video"} for the
    template to render."""
    out, images, videos = [], [], []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            if as_parts and isinstance(content, str):
                message = {**message, "content": [{"type": "text", "text": content}] if content else []}
            out.append(message)
            continue
        pieces = []
        for j, part in enumerate(content):
            part_field = f"{field}[{i}].content[{j}]"
            kind = part.get("type")
            if kind == "text":
                text = part.get("text", "")
                pieces.append({"type": "text", "text": text} if as_parts else text)
            elif kind in ("image_url", "image_pil", "video_url"):
                what = "video" if kind == "video_url" else "image"
                if placeholder is None:
                    raise MediaError(
                        f"this model takes text only: {what} parts are not supported", part_field
                    )
                if kind == "image_pil":
                    images.append(part["image_pil"])
                elif kind == "image_url":
                    images.append(load(_url(part.get(kind)), f"{part_field}.image_url"))
                elif video_placeholder is None or load_video is None:
                    raise MediaError("this model takes images, not videos", f"{part_field}.video_url")
                else:
                    videos.append(load_video(_url(part.get(kind)), f"{part_field}.video_url"))
                if as_parts:
                    pieces.append({"type": what})
                else:
                    pieces.append((video_placeholder if what == "video" else placeholder) + "\n")
            else:
                raise MediaError(f"unsupported content part type {kind!r}", f"{part_field}.type")
        out.append({**message, "content": pieces if as_parts else "".join(pieces)})
    return out, images, videos


def _url(value) -> str:
    """An `image_url`/`video_url` part's URL: OpenAI's {"url": ...}, or the URL itself."""
    return str(value.get("url") if isinstance(value, dict) else value)


def content_format(template: str, flag: str) -> str:
    """The --chat-template-content-format a template gets: the flag's, or for "auto" vLLM's guess,
    "openai" where the template loops over a message's content (`for part in message['content']`, or
    `.content`), else "string"."""
    if flag != "auto":
        return flag
    return "openai" if _loops_over_content(template) else "string"


@functools.lru_cache(maxsize=16)  # a server renders one template or a few
def _loops_over_content(template: str) -> bool:
    try:
        loops = _ENV.parse(template).find_all(nodes.For)
    except TemplateSyntaxError:
        return False  # rendering it says what is wrong
    for loop in loops:
        it = loop.iter
        if isinstance(it, nodes.Getattr) and it.attr == "content":
            return True
        if isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const) and it.arg.value == "content":
            return True
    return False
