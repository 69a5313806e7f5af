"""KV cache events (vLLM's): what the prefix cache stored and removed, for routers that follow it.

A KV-cache-aware router (llm-d's, NVIDIA Dynamo's) keeps, per engine, the tree of block hashes the
engine's prefix cache holds, and sends a request where the longest prefix of it is cached. It learns
the tree from these events, which the engine core publishes after each step (engine/engine/kv_events.py):
the device cache's (medium "GPU", recorded by the block pool), then KV offload's tiers' (recorded by
core/kv_offload.py, as vLLM's offloading connector's `take_events`): the host tier's (medium "CPU") and
the disk tier's (medium "STORAGE", vLLM's name for its file-system tier). A tier past the host's (vLLM's
secondary tiers) says where it is and which it is: the disk tier's events carry `locality` "LOCAL" (its
files are this engine's) and `ownership` "fs" (vLLM's file-system tier type); the device cache's and the
host tier's carry neither, as vLLM's block pool and CPU tier send none.

The wire format is vLLM's (vllm/distributed/kv_events.py at main: vLLM 0.26's, with what main added
since: `locality` and `ownership`, and typed `extra_keys`, vllm#55488): msgpack through msgspec, a batch
as the array [ts, events, data_parallel_rank], each event a map tagged by its class name under "type";
fields at their default are left out. A subscriber of 0.26's structs still reads every batch (its
`extra_keys` entries are `Any`: it gets the typed keys as maps).

Block hashes: ours are 32-byte SHA-256 digests (core/block_pool.py `hash_block_tokens`), chained from
the first block; vLLM's default sends a hash as the unsigned 64-bit integer of its digest's last 8 bytes
(`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`), and so do we, so routers that keep u64 keys read ours. They
are not vLLM's values (another hash of other bytes): a router that recomputes hashes from token ids
matches its own keys to ours through `token_ids` and `parent_block_hash`, as it does for vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

MEDIUM_GPU = "GPU"  # vLLM's name for the device cache, whatever the device
MEDIUM_CPU = "CPU"  # the host tier (kv_offloading_size), as vLLM's offloading connector names it
MEDIUM_STORAGE = "STORAGE"  # the disk tier (kv_offloading_disk_path), as vLLM names its file-system tier
LOCALITY_LOCAL = "LOCAL"  # a tier's storage is the publishing engine's own (vLLM's Locality.LOCAL)
OWNERSHIP_DISK = "fs"  # the secondary tier an event is of: vLLM's file-system tier type
_U64 = (1 << 64) - 1
_DIGEST_BYTES = 32  # a SHA-256 digest; a group's key appends its suffix (kv_cache_coordinator.group_hashes)


class ExtraKey(msgspec.Struct, frozen=True, gc=False, tag=True):
    """One thing a block's hash mixes in besides its token ids, typed (vLLM main's published schema):
    on the wire a map whose "type" is the subclass's tag."""


class LoRAKey(ExtraKey, frozen=True, tag="lora"):
    """The LoRA adapter the block was computed with."""

    name: str


class CacheSaltKey(ExtraKey, frozen=True, tag="cache_salt"):
    """The request's `cache_salt` (on its first block only)."""

    salt: str


class MultiModalKey(ExtraKey, frozen=True, tag="mm"):
    """An image or video frame whose placeholder tokens the block holds part of: its content hash (the
    encoder cache's key) and where its placeholders start, relative to the block's first token."""

    modality: str
    hash: str
    block_offset: int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """An event of the prefix cache; on the wire a map whose "type" is the class name."""


class BlockStored(KVCacheEvent):
    """Full blocks entered the prefix cache, in chain order: block_hashes[i] holds
    token_ids[i * block_size : (i + 1) * block_size]; the first chains to `parent_block_hash`
    (None: the request's first block)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    event_version: int = 1  # vLLM's: 1 is the typed extra keys' schema (left out at this default)
    extra_keys: list[tuple[LoRAKey | CacheSaltKey | MultiModalKey, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None  # "LOCAL" or "REMOTE" to the publisher (None: not said)
    ownership: str | None = None  # the secondary offload tier that holds the blocks (None: no such tier)


class BlockRemoved(KVCacheEvent):
    """Blocks left the prefix cache (evicted for reuse, or never written)."""

    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The prefix cache was reset: nothing it held can be hit."""


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def external_block_hash(key: bytes) -> tuple[int, int]:
    """(the hash a router sees, the KV cache group) of a prefix-cache key: group 0's keys are plain
    digests, another group's a digest and its suffix (b"group" + the id, 2 bytes little-endian)."""
    digest, suffix = key[:_DIGEST_BYTES], key[_DIGEST_BYTES:]
    group = int.from_bytes(suffix[-2:], "little") if suffix else 0
    return int.from_bytes(digest, "big") & _U64, group


def block_extra_keys(request, index: int, block_size: int) -> tuple[ExtraKey, ...] | None:
    """What block `index` of `request` mixes into its hash besides token ids, as vLLM's BlockStored
    carries it (kv_cache_utils.generate_block_hash_extra_keys, typed): the LoRA adapter's name, then
    each image the block holds part of (its content hash and its first placeholder's offset from the
    block's start), then the cache salt on the first block; None for a block of none. Our hashes
    mix the adapter and the salt into the first block only (the chain carries them on): a router
    that rebuilds vLLM's keys from these fields keys every block as vLLM would."""
    start = index * block_size
    keys = () if request.lora_request is None else (LoRAKey(request.lora_request.lora_name),)
    keys += tuple(
        MultiModalKey(f.modality, f.mm_hash, f.offset - start)
        for f in request.mm_features
        if f.overlaps(start, start + block_size)
    )
    if index == 0 and request.cache_salt is not None:
        keys += (CacheSaltKey(request.cache_salt),)
    return keys or None


def tier_events(changes: list[tuple[str, bool, bytes]]) -> list[KVCacheEvent]:
    """Offload tiers' changes, (medium, removed?, key) in the order they happened, as vLLM's offloading
    connector sends them: one event per run of stores or removals of one medium, a stored block by its
    hash only (a router knows its tokens from the device cache's BlockStored of the same hash); the disk
    tier's with its locality and ownership."""
    events: list[KVCacheEvent] = []
    for medium, is_removal, key in changes:
        block_hash = external_block_hash(key)[0]
        last = events[-1] if events else None
        where = {"locality": LOCALITY_LOCAL, "ownership": OWNERSHIP_DISK} if medium == MEDIUM_STORAGE else {}
        if last is not None and isinstance(last, BlockRemoved) == is_removal and last.medium == medium:
            last.block_hashes.append(block_hash)
        elif is_removal:
            events.append(BlockRemoved(block_hashes=[block_hash], medium=medium, **where))
        else:
            events.append(
                BlockStored(
                    block_hashes=[block_hash],
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=0,
                    lora_id=None,
                    medium=medium,
                    lora_name=None,
                    **where,
                )
            )
    return events


class KVEventRecorder:
    """Collects the events a block pool makes until the engine core takes them (once per step).

    `groups`: per KV cache group whose blocks hold tokens, (vLLM's kv_cache_spec_kind, its sliding
    window or None). A state group's snapshots (core/kv_cache_coordinator.py) hold no tokens a router
    could match: their keys make no events.
    """

    def __init__(self, block_size: int, groups: dict[int, tuple[str, int | None]]):
        self.block_size = block_size
        self.groups = groups
        self.events: list[KVCacheEvent] = []

    def record_stored(self, keys: Sequence[bytes], indices: list[int], request) -> None:
        """Blocks keys[i] for i in `indices` (ascending) of `request` entered the index: one
        BlockStored per run of consecutive indices (a block another request had indexed first breaks
        a run), chained to the key before the run."""
        group = external_block_hash(keys[indices[0]])[1]
        if group not in self.groups:
            return
        kind, window = self.groups[group]
        lora = request.lora_request
        size = self.block_size
        start = 0
        for end in range(1, len(indices) + 1):
            if end < len(indices) and indices[end] == indices[end - 1] + 1:
                continue
            first, last = indices[start], indices[end - 1]
            self.events.append(
                BlockStored(
                    block_hashes=[external_block_hash(keys[i])[0] for i in range(first, last + 1)],
                    parent_block_hash=external_block_hash(keys[first - 1])[0] if first else None,
                    token_ids=list(request.all_token_ids[first * size : (last + 1) * size]),
                    block_size=size,
                    lora_id=None if lora is None else lora.lora_int_id,
                    medium=MEDIUM_GPU,
                    lora_name=None if lora is None else lora.lora_name,
                    extra_keys=[block_extra_keys(request, i, size) for i in range(first, last + 1)],
                    group_idx=group,
                    kv_cache_spec_kind=kind,
                    kv_cache_spec_sliding_window=window,
                )
            )
            start = end

    def record_removed(self, key: bytes) -> None:
        block_hash, group = external_block_hash(key)
        if group not in self.groups:
            return
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved) and last.group_idx == group:  # one event per run of removals
            last.block_hashes.append(block_hash)
        else:
            self.events.append(BlockRemoved(block_hashes=[block_hash], medium=MEDIUM_GPU, group_idx=group))

    def record_cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call, oldest first."""
        events, self.events = self.events, []
        return events
