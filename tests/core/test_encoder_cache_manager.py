"""The encoder cache's slots and budget (core/encoder_cache_manager.py), and image-aware block hashes."""

from __future__ import annotations

import numpy as np

from xlaserve.core.encoder_cache_manager import EncoderCacheLayout, EncoderCacheManager
from xlaserve.core.kv_cache_manager import KVCacheManager
from xlaserve.core.multimodal import MultiModalFeature
from xlaserve.core.request import Request
from xlaserve.sampling_params import SamplingParams

N = 4  # tokens per image


def _request(rid: str, hashes: list[str], text: int = 2) -> Request:
    """`text` tokens, then N placeholders per image, back to back, then one more token."""
    features = [MultiModalFeature("image", h, text + i * N, N, np.zeros(1)) for i, h in enumerate(hashes)]
    return Request(
        rid, [1] * (text + N * len(hashes) + 1), SamplingParams(max_tokens=1), mm_features=features
    )


def _schedule(manager: EncoderCacheManager, request: Request, start: int, n: int) -> int:
    n = manager.fit(request, start, n)
    manager.allocate(request, start, n)
    return n


def test_an_image_is_encoded_once_and_its_slot_kept_while_referenced():
    manager = EncoderCacheManager(EncoderCacheLayout(num_slots=2, tokens_per_item=N, max_items_per_step=2))
    a, b = _request("a", ["x"]), _request("b", ["x"])
    manager.begin_step()
    assert _schedule(manager, a, 0, 4) == 4  # reaches the image's first placeholders
    manager.begin_step()
    assert _schedule(manager, b, 0, 7) == 7
    assert a.encoder_slots == b.encoder_slots == {0: 0}
    assert (manager.stats.num_encoded, manager.stats.num_hits) == (1, 1)
    # Two other images need both slots; "x" is referenced, so only one fits.
    c = _request("c", ["y", "z"])
    manager.begin_step()
    assert _schedule(manager, c, 0, 11) == 2 + N  # cut before "z": no slot for it
    manager.free(a)
    manager.free(b)
    manager.begin_step()
    assert _schedule(manager, c, 2 + N, 5) == 5  # "x" unreferenced: its slot goes to "z"
    assert c.encoder_slots == {1: 0}  # "y" (slot 1) is computed: released, cached


def test_a_step_encodes_at_most_its_budget():
    manager = EncoderCacheManager(EncoderCacheLayout(num_slots=8, tokens_per_item=N, max_items_per_step=1))
    r = _request("r", ["x", "y"])
    manager.begin_step()
    assert _schedule(manager, r, 0, 11) == 2 + N
    manager.begin_step()
    assert _schedule(manager, r, 2 + N, 5) == 5


def test_block_hashes_cover_the_images_in_each_block():
    def hashes(image: str, text: int = 4) -> list[bytes]:
        manager = KVCacheManager(block_size=4, num_blocks=16, max_model_len=64)
        request = _request("r", [image], text=text)
        manager.get_computed_blocks(request)
        return request.block_hashes

    x, y = hashes("x"), hashes("y")
    assert x[0] == y[0]  # text only
    assert x[1] != y[1]  # the image's block
    text_only = Request("t", [1] * 9, SamplingParams(max_tokens=1))
    KVCacheManager(block_size=4, num_blocks=16, max_model_len=64).get_computed_blocks(text_only)
    assert text_only.block_hashes[0] == x[0]  # a text block hashes as it always did


def test_a_chunk_past_an_image_releases_it():
    manager = EncoderCacheManager(EncoderCacheLayout(num_slots=1, tokens_per_item=N, max_items_per_step=1))
    a, b = _request("a", ["x"]), _request("b", ["y"])
    manager.begin_step()
    assert _schedule(manager, a, 0, 2 + N) == 2 + N
    manager.begin_step()
    assert _schedule(manager, b, 0, 3) == 2  # "x" holds the only slot
    manager.begin_step()
    assert _schedule(manager, a, 2 + N, 1) == 1  # past "x": released
    assert a.encoder_slots == {}
    assert _schedule(manager, b, 2, 1) == 1 and b.encoder_slots == {0: 0}


def test_bidirectional_images_are_never_cut_by_a_chunk():
    """Gemma 3's image tokens attend to each other: a chunk ending inside an image ends at its first
    token instead, or computes nothing when it started inside it; one covering the image is kept."""
    layout = EncoderCacheLayout(num_slots=4, tokens_per_item=N, max_items_per_step=4, bidirectional=True)
    manager = EncoderCacheManager(layout)
    request = _request("r", ["a", "b"])  # images at [2, 2 + N) and [2 + N, 2 + 2N), back to back
    first, second = request.mm_features
    assert manager.fit(request, 0, first.offset + 1) == first.offset
    assert manager.fit(request, 0, first.end) == first.end
    assert manager.fit(request, 0, second.offset + 2) == second.offset
    inside = first.offset + 1  # a chunk after a prefix hit inside the first image
    assert manager.fit(request, inside, 2) == 0
    assert manager.fit(request, inside, N) == first.end - inside  # the second image is cut off whole
    assert manager.fit(request, inside, first.end + N - inside) == first.end + N - inside
    # A chunk capped inside an image (long_prefill_token_threshold) runs on to its end when the step's
    # budget holds it: a cap below an image's length would otherwise hold the request forever.
    assert manager.fit(request, first.offset, 2, token_budget=N) == N
    assert manager.fit(request, inside, 2, token_budget=N) == first.end - inside
    assert manager.fit(request, inside, 2, token_budget=1) == 0
    causal = EncoderCacheManager(EncoderCacheLayout(num_slots=4, tokens_per_item=N, max_items_per_step=4))
    assert causal.fit(request, 0, first.offset + 1) == first.offset + 1
