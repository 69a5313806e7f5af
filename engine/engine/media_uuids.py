"""Media named by a client's uuid (vLLM's `uuid` of a chat part, `multi_modal_uuids` offline), so a later
request can name an image or video sent before instead of sending it again (the item None, its uuid given).

vLLM takes the uuid as the item's hash: its processor, encoder and prefix caches trust it, and a uuid
reused for another image answers with the first one's encoding. Here the uuid never keys a cache: an item
sent with its media is processed from that media, and its pixels' content hash keys the encoder and
prefix caches (core/multimodal.py). The uuid only names, in the front end, the latest media sent under it,
which a reference without media gets and processes afresh (with that request's processor settings). So
a uuid reused for another image can only change what later references name, never answer one request
with another image's encoding.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
from PIL import Image

from xlaserve.engine.media import MediaError

# The decoded media kept for references, in bytes (RGB pixels), the least recently named leaving first:
# vLLM's default processor cache (--mm-processor-cache-gb) is 4 GiB; ours holds media, not encodings.
MAX_MEDIA_BYTES = 1 << 30
MAX_UUID_CHARS = 256


class MediaByUUID:
    """The latest image or video sent under each (modality, uuid), for requests naming it (thread-safe:
    the server processes requests in worker threads)."""

    def __init__(self, max_bytes: int = MAX_MEDIA_BYTES):
        self.max_bytes = max_bytes
        self._items: OrderedDict[tuple[str, str], tuple[object, int]] = OrderedDict()
        self._num_bytes = 0
        self._lock = threading.Lock()

    def resolve(self, items: list, uuids: list | None, modality: str, fields: list[str]) -> list:
        """`items` with each None replaced by the media last sent under its uuid; each item sent with a
        uuid is kept under it. A None without a uuid, or with one naming nothing kept, is a MediaError
        naming its field."""
        uuids = uuids or [None] * len(items)
        resolved = []
        for item, uuid, field in zip(items, uuids, fields):
            key = (modality, uuid)
            with self._lock:
                if item is not None:
                    if uuid is not None:
                        self._put(key, item)
                    resolved.append(item)
                    continue
                if uuid is None:
                    raise MediaError(
                        f"no {modality} given: a part without one needs the uuid of one sent before", field
                    )
                if key not in self._items:
                    raise MediaError(
                        f"no {modality} was sent under uuid {uuid!r} (or it has left the cache); send it",
                        field,
                    )
                self._items.move_to_end(key)
                resolved.append(self._items[key][0])
        return resolved

    def _put(self, key: tuple[str, str], item) -> None:
        if key in self._items:
            self._num_bytes -= self._items.pop(key)[1]
        size = _num_bytes(item)
        if size > self.max_bytes:
            return
        self._items[key] = (item, size)
        self._num_bytes += size
        while self._num_bytes > self.max_bytes:
            self._num_bytes -= self._items.popitem(last=False)[1][1]


def check_uuids(uuids, num_items: int, field: str) -> list | None:
    """A modality's multi_modal_uuids (vLLM's: one string or None for one item, else a list of them, one
    per item) as a list; a ValueError naming `field` where its shape or entries are wrong."""
    if uuids is None:
        return None
    uuids = [uuids] if isinstance(uuids, str) else uuids
    if not isinstance(uuids, (list, tuple)) or len(uuids) != num_items:
        raise ValueError(
            f"{field} must hold one uuid (a string, or None) per item: {num_items}, got {uuids!r}"
        )
    for uuid in uuids:
        if uuid is not None and not (isinstance(uuid, str) and 0 < len(uuid) <= MAX_UUID_CHARS):
            raise ValueError(
                f"{field} entries must be strings of 1 to {MAX_UUID_CHARS} characters or None, got {uuid!r}"
            )
    return list(uuids)


def _num_bytes(item) -> int:
    """Bytes an image or video holds (PIL images by their RGB pixels)."""
    if isinstance(item, Image.Image):
        return item.width * item.height * 3
    if isinstance(item, np.ndarray):
        return item.nbytes
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], dict):  # (frames, metadata)
        return _num_bytes(item[0])
    if isinstance(item, (list, tuple)):
        return sum(_num_bytes(x) for x in item)
    return 0
