"""Which images' encoder outputs the device holds: slots by content hash, and each step's encoder budget.

vLLM's `encoder_cache_manager`, for encoders whose output has a fixed number of rows per image (LLaVA:
one embedding per patch). The worker keeps a device array of `num_slots` slots of `tokens_per_item`
rows each (worker/mm_encoder.py); this manager decides which image lives in which slot, so an image is
encoded once and read by every chunk of its prompt and by every later request that sends it again.

- A request references the images its scheduled tokens reach, from the step that first reaches an
  image's placeholders until a later chunk starts past them (or the request finishes or is preempted);
  a slot referenced by anyone is never reassigned. (Async scheduling: the step still in flight may read
  a slot the next step reassigns; the device runs the next step's encode after it, as the cache array
  is donated to it.)
- An image nobody references stays cached (a hit for the next request with it) until its slot is
  needed: unreferenced slots are reassigned least recently used first.
- A step encodes at most `max_items_per_step` images (the encoder program's largest bucket), so a
  chunk stops before an image that would exceed it, or that finds no slot, and goes on next step.

Scheduling is two-phase, so that a request whose KV blocks then do not fit takes nothing: `fit` says
how many of the tokens it may compute (no side effect), `allocate` takes the references and slots once
its blocks are allocated. Plain Python: no jax.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from xlaserve.core.request import Request


@dataclass(frozen=True)
class EncoderCacheLayout:
    """The worker's encoder cache, as the executor reports it (worker/mm_encoder.py)."""

    num_slots: int  # images held at once
    tokens_per_item: int  # encoder output rows per image (= its placeholder tokens)
    max_items_per_step: int  # images one step may encode (the encoder program's largest bucket)
    # An image's tokens attend to each other both ways (Gemma 3): a chunk never ends inside one.
    bidirectional: bool = False


@dataclass
class EncoderCacheStats:
    """Images looked up by scheduled chunks since the last snapshot: found cached, or encoded."""

    num_hits: int = 0
    num_encoded: int = 0


class EncoderCacheManager:
    def __init__(self, layout: EncoderCacheLayout | None = None):
        """`layout` None: a text-only engine (a request with images is refused before it gets here)."""
        layout = layout or EncoderCacheLayout(0, 0, 0)
        self.layout = layout
        self.max_items_per_step = layout.max_items_per_step
        self._slots: dict[str, int] = {}  # mm_hash -> slot
        self._refs: dict[str, set[str]] = {}  # mm_hash -> ids of the requests that reference it
        self._unreferenced: OrderedDict[str, None] = OrderedDict()  # cached, reassignable, LRU first
        self._free_slots = list(range(layout.num_slots - 1, -1, -1))
        self._step_encodes: set[str] = set()  # images this step encodes (the budget)
        self.stats = EncoderCacheStats()

    def begin_step(self) -> None:
        """A new step: its encoder budget is whole again."""
        self._step_encodes = set()

    def fit(self, request: Request, start: int, num_new_tokens: int, token_budget: int | None = None) -> int:
        """How many of positions [start, start + num_new_tokens) the request may compute this step: all,
        or up to the first image that finds no slot or no room in the step's encoder budget. With
        bidirectional images a chunk never ends inside one: it runs on to the image's end when the
        step's `token_budget` holds that (past a prefill chunk cap: an image is short, and a cap
        below it would hold the request forever), else it stops at the image's first token (none this
        step when the chunk starts inside it)."""
        if not request.mm_features:
            return num_new_tokens
        num_new_tokens = self._fit_encodes(request, start, num_new_tokens)
        if self.layout.bidirectional:
            for feature in reversed(request.mm_features):  # a cut lands on an earlier image's first token
                if feature.offset < start + num_new_tokens < feature.end:
                    fits = token_budget is not None and feature.end - start <= token_budget
                    num_new_tokens = feature.end - start if fits else max(feature.offset - start, 0)
        return num_new_tokens

    def _fit_encodes(self, request: Request, start: int, num_new_tokens: int) -> int:
        stop = start + num_new_tokens
        reached = [f for f in request.mm_features if f.overlaps(start, stop)]
        # Cached images the chunk reaches are referenced before any slot is reassigned: not candidates.
        hits = {f.mm_hash for f in reached if f.mm_hash in self._slots}
        num_reassignable = len(self._free_slots) + len(self._unreferenced.keys() - hits)
        new_hashes: set[str] = set()
        for feature in reached:
            if feature.mm_hash in hits or feature.mm_hash in new_hashes:
                continue
            num_new = len(self._step_encodes | new_hashes) + 1
            if num_new > self.max_items_per_step or len(new_hashes) + 1 > num_reassignable:
                return max(feature.offset - start, 0)
            new_hashes.add(feature.mm_hash)
        return num_new_tokens

    def allocate(self, request: Request, start: int, num_new_tokens: int) -> None:
        """Reference every image that positions [start, start + num_new_tokens) reach, giving a slot
        to each one not cached (`fit` said they fit); sets `request.encoder_slots`."""
        stop = start + num_new_tokens
        for index in [i for i in request.encoder_slots if request.mm_features[i].end <= start]:
            self._release(request, index)  # computed: its slot may go to another image
        reached = [
            (index, f)
            for index, f in enumerate(request.mm_features)
            if f.overlaps(start, stop) and index not in request.encoder_slots
        ]
        # Hits first, so that no slot this chunk reads is the one a new image is given.
        for index, feature in sorted(reached, key=lambda item: item[1].mm_hash not in self._slots):
            mm_hash = feature.mm_hash
            if mm_hash in self._slots:
                if mm_hash not in self._step_encodes:
                    self.stats.num_hits += 1
            else:
                self._slots[mm_hash] = self._take_slot()
                self._step_encodes.add(mm_hash)
                self.stats.num_encoded += 1
            self._unreferenced.pop(mm_hash, None)
            self._refs.setdefault(mm_hash, set()).add(request.request_id)
            request.encoder_slots[index] = self._slots[mm_hash]

    def free(self, request: Request) -> None:
        """Drop the request's references (finished or preempted); unreferenced images stay cached."""
        for index in list(request.encoder_slots):
            self._release(request, index)

    def _release(self, request: Request, index: int) -> None:
        del request.encoder_slots[index]
        mm_hash = request.mm_features[index].mm_hash
        holders = self._refs.get(mm_hash)
        if holders is None:
            return
        holders.discard(request.request_id)
        if not holders:
            del self._refs[mm_hash]
            self._unreferenced[mm_hash] = None

    def make_stats(self) -> EncoderCacheStats:
        """Snapshot the counters and start counting afresh."""
        stats, self.stats = self.stats, EncoderCacheStats()
        return stats

    @property
    def num_cached(self) -> int:
        return len(self._slots)

    def _take_slot(self) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        victim, _ = self._unreferenced.popitem(last=False)  # `fit` checked one is there
        return self._slots.pop(victim)
