"""Video files -> the frames a vision-language model reads: decoded with PyAV (FFmpeg), sampled uniformly.

PyAV is the `video` extra (`pip install 'xlaserve[video]'`), imported only when a video arrives: a server
without it refuses a video part by name and serves everything else. Frames are sampled as vLLM's video
loader samples them: `num_frames` indices spread evenly over the file (`np.linspace(0, total - 1,
num_frames)` rounded down), every frame when the file has no more than that (or `num_frames` is -1).
The kept frames' own rate, frames kept / the file's duration, is what the model's temporal positions
use (Qwen's `second_per_grid_ts` = temporal_patch_size / fps), so two pairs of frames a second apart in
the file are a second apart in the positions, however many frames were kept.

Every refusal is a `MediaError` naming the request's field. Blocking work: called from a worker thread.
"""

from __future__ import annotations

import io

import numpy as np

from xlaserve.config.multimodal import DEFAULT_VIDEO_NUM_FRAMES
from xlaserve.engine.media import MAX_VIDEO_BYTES, MediaError, MediaPolicy, media_bytes

# A kept frame's pixels, read from the stream's header before any frame is decoded: 4K. The model's
# processor resizes every frame to its max_pixels anyway; this bounds the memory of the kept frames.
MAX_FRAME_PIXELS = 3840 * 2160
INSTALL_HINT = "decoding a video needs PyAV: install the video extra (pip install 'xlaserve[video]')"


def load_video(url: str, policy: MediaPolicy, field: str) -> tuple[np.ndarray, dict]:
    """The (frames, metadata) of the video a video part's URL names, `policy.video_num_frames` kept
    (media.py: which URLs; `decode_video`: the frames)."""
    data = media_bytes(url, policy, field, "video", MAX_VIDEO_BYTES)
    return decode_video(data, field, policy.video_num_frames)


def sample_indices(total: int, num_frames: int) -> np.ndarray:
    """Which of a file's `total` frames are kept: `num_frames` spread evenly, first and last included;
    all of them when the file has no more (or `num_frames` is -1)."""
    if num_frames == -1 or total <= num_frames:
        return np.arange(total)
    return np.linspace(0, total - 1, num_frames, dtype=np.int64)


def decode_video(
    data: bytes, field: str, num_frames: int = DEFAULT_VIDEO_NUM_FRAMES
) -> tuple[np.ndarray, dict]:
    """Encoded bytes (mp4, webm, mkv, ...) -> (the kept frames, uint8 [T, H, W, 3] RGB; their metadata:
    `fps` the kept frames' rate, or None when the file states no duration, `total_num_frames`,
    `frames_indices`, `duration` seconds), vLLM's (frames, metadata) pair."""
    av = _import_av(field)
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:  # FFmpeg drops a track without samples: no frames either
                raise MediaError("the video has no frames", field)
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            if width * height > MAX_FRAME_PIXELS:
                raise MediaError(
                    f"the video's frames are {width}x{height}; at most {MAX_FRAME_PIXELS} pixels a frame",
                    field,
                )
            total = _count_frames(container, stream)
            if total == 0:
                raise MediaError("the video has no frames", field)
            duration = _duration(container, stream, total)
            indices = sample_indices(total, num_frames)
            frames = _decode_frames(container, stream, set(indices.tolist()))
    except MediaError:
        raise
    except (av.FFmpegError, ValueError, OSError, EOFError):
        raise MediaError("the data is not a video PyAV can decode (mp4, webm, mkv, ...)", field) from None
    indices = indices[: len(frames)]  # fewer when the header counted frames the stream does not hold
    if not frames:
        raise MediaError("the video has no frames", field)
    if len({frame.shape for frame in frames}) > 1:
        raise MediaError("the video's frames change size; they must share one", field)
    metadata = {
        "fps": len(frames) / duration if duration else None,
        "total_num_frames": total,
        "frames_indices": indices.tolist(),
        "duration": duration,
    }
    return np.stack(frames), metadata


def _import_av(field: str):
    try:
        import av
    except ImportError:
        raise MediaError(INSTALL_HINT, field) from None
    return av


def _count_frames(container, stream) -> int:
    """The stream's frames: its header's count, else its packets counted (demuxed, not decoded)."""
    if stream.frames:
        return int(stream.frames)
    count = sum(1 for packet in container.demux(stream) if packet.size)
    container.seek(0, stream=stream)
    return count


def _duration(container, stream, total: int) -> float | None:
    """The file's seconds: its frames over their average rate, else the stream's or the container's
    stated duration; None when it states none."""
    rate = stream.average_rate or stream.guessed_rate
    if rate:
        return total / float(rate)
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration:
        return container.duration / 1_000_000  # AV_TIME_BASE
    return None


def _decode_frames(container, stream, keep: set[int]) -> list[np.ndarray]:
    """The frames at `keep` (indices in decoding order) as RGB arrays; decoding stops after the last."""
    frames, last = [], max(keep)
    for index, frame in enumerate(container.decode(stream)):
        if index in keep:
            frames.append(frame.to_ndarray(format="rgb24"))
        if index >= last:
            break
    return frames
