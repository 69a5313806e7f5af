"""Images and videos from requests: where they may come from, and how large they may be, checked before
decoding.

An image (or video) part's URL is a `data:` URL (base64), a `file://` path under the allowed local
directory, or an `http(s)://` URL whose host the server allows (`--allowed-media-domains`); anything
else is refused. Pillow reads an image's size from its header without decoding the pixels, so a 10k x
10k image (or a few bytes claiming to be one) is refused by `MAX_IMAGE_PIXELS` before any pixel memory
is taken. Videos come from the same places, up to `MAX_VIDEO_BYTES` (a data URL also within the
server's body limit), and are decoded by engine/engine/video.py. Every refusal is a `MediaError` naming
the request's field. Blocking work (decoding, reading files): the server calls these from a worker
thread, never on the event loop.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import os
import urllib.parse
import urllib.request
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from xlaserve.config.multimodal import DEFAULT_VIDEO_NUM_FRAMES

# 40 megapixels (e.g. 8000 x 5000): well past any vision encoder's input, far under Pillow's own
# decompression-bomb bound (~89M), and ~120 MB as RGB once decoded.
MAX_IMAGE_PIXELS = 40_000_000
# Smaller images are refused: Hugging Face's processors guess the channel axis from the array's shape,
# and a side of 1 or 3 pixels reads as a channel axis.
MIN_IMAGE_SIDE = 4
MAX_IMAGE_BYTES = 20 * 1024 * 1024  # an encoded image (data URL, file or download)
MAX_VIDEO_BYTES = 256 * 1024 * 1024  # an encoded video (a file or download; a data URL meets the body's)
# Seconds a download may take, per kind: vLLM's defaults (VLLM_IMAGE_FETCH_TIMEOUT 5, VLLM_VIDEO_FETCH_TIMEOUT
# 30), each moved by its XLASERVE_ name (`fetch_timeouts`). A video is larger, so it gets longer.
DEFAULT_FETCH_TIMEOUTS_S = {"image": 5.0, "video": 30.0}


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect could lead anywhere, past the allow-list: it is an error (urllib raises HTTPError)."""

    def redirect_request(self, *args, **kwargs):
        return None


_OPENER = urllib.request.build_opener(_NoRedirects)


def fetch_timeouts() -> dict[str, float]:
    """Seconds a download of each kind may take: XLASERVE_IMAGE_FETCH_TIMEOUT and XLASERVE_VIDEO_FETCH_TIMEOUT
    (seconds, > 0), else DEFAULT_FETCH_TIMEOUTS_S; a bad value is a ValueError naming the variable."""
    timeouts = {}
    for what, default in DEFAULT_FETCH_TIMEOUTS_S.items():
        name = f"XLASERVE_{what.upper()}_FETCH_TIMEOUT"
        text = os.environ.get(name)
        try:
            value = default if text is None else float(text)
        except ValueError:
            value = -1.0
        if not 0 < value < float("inf"):
            raise ValueError(f"{name} must be a number of seconds > 0, got {text!r}")
        timeouts[what] = value
    return timeouts


class MediaError(ValueError):
    """An image or video a request cannot use; `field` names it (e.g. messages[0].content[1].image_url)."""

    def __init__(self, message: str, field: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class MediaPolicy:
    """Where images and videos may come from (vLLM's --allowed-local-media-path and
    --allowed-media-domains), the frames a video keeps (--media-io-kwargs' video.num_frames; -1: all),
    and the seconds a download of each kind may take (read from the environment as the policy is made:
    a server refuses a bad value at start)."""

    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] = ()
    video_num_frames: int = DEFAULT_VIDEO_NUM_FRAMES
    fetch_timeouts_s: dict[str, float] = dataclasses.field(default_factory=fetch_timeouts)


def load_image(url: str, policy: MediaPolicy, field: str) -> Image.Image:
    """The RGB image an image part's URL names (module doc: which URLs, which sizes)."""
    return decode_image(media_bytes(url, policy, field, "image", MAX_IMAGE_BYTES), field)


def media_bytes(url: str, policy: MediaPolicy, field: str, what: str, max_bytes: int) -> bytes:
    """The encoded bytes `url` names (an `what`, "image" or "video", of at most `max_bytes`), from where
    `policy` allows."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url_bytes(url, field, what, max_bytes)
    if scheme == "file":
        return _file_bytes(url, policy, field, what, max_bytes)
    if scheme in ("http", "https"):
        return _fetch(url, policy, field, what, max_bytes)
    raise MediaError(
        f"the {what} URL must be a data: URL (base64), or an allowed file:// or http(s):// URL", field
    )


def decode_image(data: bytes, field: str) -> Image.Image:
    """Encoded bytes -> an RGB image; its size is checked from the header before the pixels are decoded."""
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError:  # Pillow's own bound (2x its MAX_IMAGE_PIXELS), past ours
        raise MediaError(
            f"the image has more than {2 * Image.MAX_IMAGE_PIXELS} pixels; at most {MAX_IMAGE_PIXELS} pixels",
            field,
        ) from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise MediaError(
            "the data is not an image Pillow can read (PNG, JPEG, WebP, GIF, ...)", field
        ) from None
    return check_image(image, field, decode=True)


def check_image(image: Image.Image, field: str, *, decode: bool = False) -> Image.Image:
    """`image` (a PIL image) within the size limits, as RGB; `decode`: its pixels are read here."""
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise MediaError(
            f"the image is {width}x{height} ({width * height} pixels); at most {MAX_IMAGE_PIXELS} pixels",
            field,
        )
    if min(width, height) < MIN_IMAGE_SIDE:
        raise MediaError(
            f"the image is {width}x{height}; each side must be at least {MIN_IMAGE_SIDE} pixels", field
        )
    try:
        if decode:
            image.load()
        return image.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        raise MediaError("the image data is corrupt or truncated", field) from None


def _data_url_bytes(url: str, field: str, what: str, max_bytes: int) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.lower().endswith(";base64"):
        raise MediaError("a data URL must be data:<media type>;base64,<data>", field)
    if len(payload) > max_bytes * 4 // 3 + 4:
        raise MediaError(f"the {what} is larger than {max_bytes} bytes", field)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("the data URL's payload is not valid base64", field) from None
    if len(data) > max_bytes:  # the length check above is the encoding's bound, a few bytes loose
        raise MediaError(f"the {what} is larger than {max_bytes} bytes", field)
    return data


def _file_bytes(url: str, policy: MediaPolicy, field: str, what: str, max_bytes: int) -> bytes:
    root = policy.allowed_local_media_path
    if root is None:
        raise MediaError("file:// URLs are refused: the server has no --allowed-local-media-path", field)
    path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlparse(url).path))
    root = os.path.realpath(root)
    if os.path.commonpath([path, root]) != root:
        raise MediaError("the file is outside --allowed-local-media-path", field)
    try:
        if os.path.getsize(path) > max_bytes:
            raise MediaError(f"the {what} is larger than {max_bytes} bytes", field)
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        raise MediaError("the file cannot be read", field) from None


def _fetch(url: str, policy: MediaPolicy, field: str, what: str, max_bytes: int) -> bytes:
    host = (urllib.parse.urlparse(url).hostname or "").lower()
    if host not in policy.allowed_media_domains:
        raise MediaError(f"the host {host!r} is not in --allowed-media-domains", field)
    try:
        with _OPENER.open(url, timeout=policy.fetch_timeouts_s[what]) as response:
            data = response.read(max_bytes + 1)
    except OSError:
        raise MediaError(f"the {what} could not be downloaded", field) from None
    if len(data) > max_bytes:
        raise MediaError(f"the {what} is larger than {max_bytes} bytes", field)
    return data
