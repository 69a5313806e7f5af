"""Media inputs' front-end rules without an engine: download timeouts per kind (vLLM's defaults under
XLASERVE_ names), media named by uuid (engine/engine/media_uuids.py) and the Qwen VL families' per-request
mm_processor_kwargs checks. The paths through a server: tests/entrypoints/test_server_videos.py."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from xlaserve.engine import media
from xlaserve.engine.media import MediaError, MediaPolicy, media_bytes
from xlaserve.engine.media_uuids import MediaByUUID, check_uuids
from xlaserve.engine.qwen_vl_processor import check_request_kwargs

SETTINGS = {"min_pixels": 1024, "max_pixels": 4096}


class _Response:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def read(self, n):
        return b"bytes"


@pytest.mark.parametrize(
    ("env", "image_s", "video_s"),
    [
        ({}, 5.0, 30.0),
        ({"XLASERVE_IMAGE_FETCH_TIMEOUT": "2.5", "XLASERVE_VIDEO_FETCH_TIMEOUT": "90"}, 2.5, 90.0),
    ],
)
def test_downloads_wait_as_long_as_their_kind_allows(monkeypatch, env, image_s, video_s):
    """vLLM's VLLM_IMAGE_FETCH_TIMEOUT (5 s) and VLLM_VIDEO_FETCH_TIMEOUT (30 s) defaults, each moved by its
    XLASERVE_ name; the policy reads them as it is made."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    timeouts = []
    monkeypatch.setattr(media._OPENER, "open", lambda url, timeout: timeouts.append(timeout) or _Response())
    policy = MediaPolicy(allowed_media_domains=("media.example.com",))
    for what in ("image", "video"):
        assert media_bytes(f"https://media.example.com/x.{what}", policy, "f", what, 100) == b"bytes"
    assert timeouts == [image_s, video_s]


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf", "nan"])
def test_a_bad_fetch_timeout_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("XLASERVE_VIDEO_FETCH_TIMEOUT", value)
    with pytest.raises(
        ValueError, match=f"XLASERVE_VIDEO_FETCH_TIMEOUT must be a number of seconds > 0, got '{value}'"
    ):
        MediaPolicy()


def _image(value: int, size=(8, 8)) -> Image.Image:
    return Image.new("RGB", size, (value, value, value))


def test_a_uuid_names_the_media_last_sent_under_it():
    """A None item is the media last sent under its uuid; a uuid sent again with other media names that
    from then on, and the request that sent it gets its own media."""
    store = MediaByUUID()
    first, second = _image(1), _image(2)
    assert store.resolve([first], ["a"], "image", ["i0"]) == [first]
    assert store.resolve([None], ["a"], "image", ["i0"]) == [first]
    assert store.resolve([second], ["a"], "image", ["i0"]) == [second]
    assert store.resolve([None, None], ["a", "a"], "image", ["i0", "i1"]) == [second, second]
    with pytest.raises(MediaError, match="no video was sent under uuid 'a'") as e:  # kinds apart
        store.resolve([None], ["a"], "video", ["v0"])
    assert e.value.field == "v0"
    with pytest.raises(MediaError, match="needs the uuid of one sent before") as e:
        store.resolve([first, None], None, "image", ["i0", "i1"])
    assert e.value.field == "i1"


def test_media_leave_the_store_least_recently_named_first():
    store = MediaByUUID(max_bytes=2 * 8 * 8 * 3)  # two 8 x 8 RGB images
    images = [_image(i) for i in range(3)]
    store.resolve(images[:2], ["a", "b"], "image", ["i0", "i1"])
    store.resolve([None], ["a"], "image", ["i0"])  # "b" is now the least recently named
    store.resolve([images[2]], ["c"], "image", ["i0"])
    assert store.resolve([None, None], ["a", "c"], "image", ["i0", "i1"]) == [images[0], images[2]]
    with pytest.raises(MediaError, match="left the cache"):
        store.resolve([None], ["b"], "image", ["i0"])
    store.resolve([_image(9, (64, 64))], ["big"], "image", ["i0"])  # larger than the store: not kept
    with pytest.raises(MediaError, match="left the cache"):
        store.resolve([None], ["big"], "image", ["i0"])
    video = (np.zeros((2, 8, 8, 3), np.uint8), {"fps": 2.0})
    assert store.resolve([video], ["v"], "video", ["v0"])[0] is video
    assert store.resolve([None], ["v"], "video", ["v0"])[0] is video


@pytest.mark.parametrize(
    ("uuids", "count", "message"),
    [
        (["a"], 2, "one uuid .* per item: 2"),
        ({"a": 1}, 1, "one uuid .* per item: 1"),
        ([5], 1, "entries must be strings"),
        ([""], 1, "entries must be strings"),
        (["x" * 257], 1, "entries must be strings"),
    ],
)
def test_bad_multi_modal_uuids_are_refused(uuids, count, message):
    with pytest.raises(ValueError, match=message):
        check_uuids(uuids, count, "multi_modal_uuids.image")


def test_multi_modal_uuids_take_vllms_shapes():
    assert check_uuids("a", 1, "f") == ["a"]
    assert check_uuids(["a", None], 2, "f") == ["a", None]
    assert check_uuids(None, 3, "f") is None


@pytest.mark.parametrize(
    ("kwargs", "field", "message"),
    [
        (
            {"size": {"longest_edge": 1}},
            "size",
            r"not a per-request setting .* \['min_pixels', 'max_pixels', 'fps'\]",
        ),
        ({"max_pixels": 4097}, "max_pixels", "at most 4096, the server's max_pixels"),
        ({"max_pixels": 0}, "max_pixels", "must be a positive integer"),
        ({"max_pixels": 2048.0}, "max_pixels", "must be a positive integer"),
        ({"min_pixels": True}, "min_pixels", "must be a positive integer"),
        ({"min_pixels": 2048, "max_pixels": 1024}, "min_pixels", r"2048 is more than max_pixels \(1024\)"),
        ({"min_pixels": 8192}, "min_pixels", r"8192 is more than max_pixels \(4096\)"),
        ({"fps": 0}, "fps", "must be a number of frames a second > 0"),
        ({"fps": "2"}, "fps", "must be a number of frames a second > 0"),
    ],
)
def test_qwen_vl_request_kwargs_are_checked_against_the_server(kwargs, field, message):
    with pytest.raises(MediaError, match=message) as e:
        check_request_kwargs(kwargs, SETTINGS, "mm_processor_kwargs")
    assert e.value.field == f"mm_processor_kwargs.{field}"


def test_qwen_vl_request_kwargs_within_the_server_are_taken():
    check_request_kwargs({"min_pixels": 64, "max_pixels": 4096, "fps": 0.5}, SETTINGS, "f")
    check_request_kwargs({"max_pixels": 1024}, SETTINGS, "f")  # the server's min_pixels, 1024, fits
