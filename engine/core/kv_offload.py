"""Host offload, the scheduler's half: which prefixes the host tier holds, and each step's transfers.

Blocks the device prefix cache evicts are copied to host memory (`kv_offloading_size` GiB of numpy
arrays, worker/kv_offload.py) under the same chained block hashes that index the device cache, so a
hash still names one prefix of one tenant: the cache salt and the LoRA adapter enter the first block's
hash (core/kv_cache_manager.py), and one tenant can never read another's blocks. A new request that
hits the device cache for its first n blocks asks the host tier for the blocks after them; those it
finds get device blocks and are loaded before the step, and count as computed (and in
`num_cached_tokens`).

With a disk tier (`kv_offloading_disk_path`), a block the host tier evicts is demoted to a disk slot
(its own index, least recently used first out, under the same hash) instead of dropped; a prefix's
blocks may then come from either tier, in order, and a disk hit loads straight to the device.

This half is bookkeeping only: host (and disk) slots by hash, least recently used first out. The bytes
live with the worker, which receives (device block, slot) pairs in each step's KVConnectorMetadata.

A persistent disk tier (`kv_offloading_disk_persist`) outlives the engine: at a clean shutdown every
cached block not on the disk yet (the host tier's, then the device cache's, the most recent last, as
many as the tier holds) is written to it, and then its index (hash -> slot, least recently used first)
beside its files, in a directory named after what the blocks' bytes depend on (`persistent_tier_dir`:
the checkpoint's files, dtypes, block size, parallel layout). The next engine of the same settings on
the same path starts with that index and removes the file, so an engine that dies without shutting
down leaves no index behind and the one after it starts empty (its files are overwritten). A reset of
the prefix cache (a weight update, sleep) keeps nothing: the tier's identity is the checkpoint's.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
from collections import OrderedDict
from itertools import takewhile

import numpy as np

from xlaserve.config import EngineConfig
from xlaserve.core.kv_cache_manager import skips_prefix_cache
from xlaserve.core.kv_connector import KVConnectorMetadata, KVConnectorScheduler, KVTransferStats
from xlaserve.core.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, KVCacheEvent, tier_events
from xlaserve.core.request import Request

logger = logging.getLogger(__name__)

GIB = 2**30
# Files of a checkpoint whose change changes the K/V (a persistent tier's identity).
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".json")
PERSISTED_INDEX = "index.npz"
HASH_BYTES = 32  # a block hash: a SHA-256 digest (core/block_pool.py)


def num_host_blocks(size: float, bytes_per_block: int, field: str = "kv_offloading_size") -> int:
    """Blocks `size` GiB holds (a tier's); ValueError naming the field when not even one."""
    num_blocks = int(size * GIB // bytes_per_block)
    if num_blocks < 1:
        raise ValueError(
            f"{field} ({size} GiB) holds no KV block of {bytes_per_block} bytes; "
            f"raise it to at least {bytes_per_block / GIB:.3g}"
        )
    return num_blocks


def persistent_tier_dir(config: EngineConfig, bytes_per_block: int) -> str | None:
    """The directory of the persistent disk tier under kv_offloading_disk_path (None: not persistent):
    named by a digest of what a block's bytes depend on, so an engine of other settings never reads
    them, and by the data-parallel rank past the first (each rank keeps its own index, files and lock;
    rank 0's is a single engine's, whose blocks are the same bytes). Both halves (the scheduler's index,
    the worker's files) name it alike."""
    cache = config.cache
    if not cache.kv_offloading_disk_persist:
        return None
    model, parallel = config.model, config.parallel
    identity = {
        "format": 1,
        "xlaserve": importlib.metadata.version("xlaserve"),
        "weights": _weights_identity(model.model),
        "load_format": model.load_format,
        "seed": model.seed if model.load_format == "dummy" else None,
        "model": [model.dtype, model.quantization, model.hf_overrides, model.batch_invariant],
        # A drafter's cache rows ride in each block (worker/kv_plumbing.py): a tier of an engine without
        # one, or with another, holds other arrays.
        "draft": _draft_identity(config.speculative),
        "cache": [cache.kv_cache_dtype, cache.block_size, bytes_per_block, cache.disk_tier_size],
        "parallel": [
            parallel.tensor_parallel_size,
            parallel.pipeline_parallel_size,
            parallel.decode_context_parallel_size,
            parallel.prefill_context_parallel_size,
        ],
    }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()
    rank = parallel.data_parallel_rank
    name = f"xlaserve-kv-{digest[:20]}" + (f"-dp{rank}" if rank else "")
    return os.path.join(cache.kv_offloading_disk_path, name)


def _draft_identity(speculative) -> list | None:
    """What a drafter's cache rows depend on (None: no drafter cache): its method, and a draft model's
    checkpoint (an MTP or EAGLE-3 layer's: the target's, or its own named checkpoint)."""
    if speculative is None or not speculative.has_draft_cache:
        return None
    return [speculative.method, _weights_identity(speculative.model)]


def _weights_identity(model: str | None) -> list:
    """The checkpoint as (file, size, modified) of its weight and config files (a name that is no path:
    the name, the embedded model's)."""
    path = os.path.abspath(os.path.expanduser(model)) if model else None
    if path is None or not os.path.exists(path):
        return [model]
    if os.path.isfile(path):
        files = [path]
    else:
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(_WEIGHT_SUFFIXES))
    return [[f, (st := os.stat(f)).st_size, st.st_mtime_ns] for f in files]


class HostBlockIndex:
    """A tier's slots (host, or disk) by block hash, least recently used first: a bounded LRU with O(1)
    lookups.

    A slot being loaded or written this step is pinned until the step's plan is built (`unpin_all`), so
    no other block of the same step takes it over: a plan never names one slot twice, and the index
    names the block whose bytes the slot gets. `on_evict(block_hash, slot)` hears of each eviction
    before its slot is reused (a disk tier's demotion)."""

    def __init__(self, num_blocks: int, on_evict=None):
        self.num_blocks = num_blocks
        self.on_evict = on_evict
        self.slot_of: OrderedDict[bytes, int] = OrderedDict()  # LRU first
        self.num_used = 0  # slots 0 .. num_used - 1 have been given out (a disk tier's may be millions)
        self.pinned: set[int] = set()
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self.slot_of)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.slot_of

    def num_leading_hits(self, block_hashes: list[bytes]) -> int:
        """How many of `block_hashes`, from the first, the tier holds."""
        num_hits = 0
        for block_hash in block_hashes:
            if block_hash not in self.slot_of:
                break
            num_hits += 1
        return num_hits

    def take_for_load(self, block_hash: bytes) -> int:
        """The hash's slot, marked most recently used and pinned until `unpin_all`."""
        self.slot_of.move_to_end(block_hash)
        slot = self.slot_of[block_hash]
        self.pinned.add(slot)
        return slot

    def allocate(self, block_hash: bytes) -> int | None:
        """A slot for a new hash (evicting the least recently used unpinned one when full), pinned; None
        when every slot is pinned."""
        if self.num_used < self.num_blocks:
            slot = self.num_used
            self.num_used += 1
        else:
            victim = next((h for h, s in self.slot_of.items() if s not in self.pinned), None)
            if victim is None:
                return None
            slot = self.slot_of.pop(victim)
            self.num_evicted += 1
            if self.on_evict is not None:
                self.on_evict(victim, slot)
        self.slot_of[block_hash] = slot
        self.pinned.add(slot)
        return slot

    def unpin_all(self) -> None:
        self.pinned.clear()

    def clear(self) -> None:
        self.slot_of.clear()
        self.num_used = 0
        self.pinned.clear()


class OffloadingConnectorScheduler(KVConnectorScheduler):
    """Evicted device blocks go to the host tier (and what it evicts to the disk tier, when there is
    one); hits after a device hit come back from either.

    `enable_kv_cache_events`: each tier's stores and evictions are recorded as vLLM's offloading
    connector publishes them (BlockStored / BlockRemoved with medium "CPU" for the host tier, "STORAGE"
    for the disk tier: its demotions, its evictions, a persistent tier's blocks found at start-up), so a
    router knows which prefixes a hit of either tier serves. A hit changes no tier (the device cache's
    BlockStored names the blocks it loads); off, nothing is recorded."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        bytes_per_block: int,
        num_disk_blocks: int = 0,
        persist_dir: str | None = None,
        enable_kv_cache_events: bool = False,
    ):
        # (medium, removed?, hash) of the tiers, in order, since the last take_events; None: events off.
        self._changes: list[tuple[str, bool, bytes]] | None = [] if enable_kv_cache_events else None
        on_evict = self._on_host_evict if num_disk_blocks or enable_kv_cache_events else None
        self.index = HostBlockIndex(num_blocks, on_evict=on_evict)
        on_disk_evict = self._on_disk_evict if enable_kv_cache_events else None
        self.disk = HostBlockIndex(num_disk_blocks, on_evict=on_disk_evict) if num_disk_blocks else None
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self._evicted: dict[bytes, int] = {}  # hash -> device block, not yet saved
        # device block -> host (or disk) slot, this step (a later load into the same block wins)
        self._loads: dict[int, int] = {}
        self._disk_loads: dict[int, int] = {}
        self._demotes: list[tuple[int, int]] = []  # (host slot, disk slot), this step
        self.stats = KVTransferStats()
        # A persistent disk tier: its directory, locked while this engine runs, and whether its blocks
        # still are the checkpoint's (a reset of the prefix cache keeps nothing at shutdown).
        self.persist_dir = persist_dir
        self._lock = None
        self._keep = False
        if persist_dir is not None:
            self._open_persisted(persist_dir)

    def _open_persisted(self, folder: str) -> None:
        """Lock the tier's directory and take the index the last engine kept there (removing its file)."""
        os.makedirs(folder, exist_ok=True)
        lock = open(os.path.join(folder, "lock"), "w")  # noqa: SIM115  (held until shut_down)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            raise ValueError(
                f"kv_offloading_disk_path: the persistent tier {folder} is in use by another engine; "
                "give this one a path of its own"
            ) from None
        self._lock, self._keep = lock, True
        path = os.path.join(folder, PERSISTED_INDEX)
        if not os.path.exists(path):
            logger.info("KV offload: persistent disk tier %s starts empty", folder)
            return
        with np.load(path) as saved:
            hashes, slots, num_used = saved["hashes"], saved["slots"], int(saved["num_used"])
        os.remove(path)  # an engine that dies before its shutdown keeps none: the next starts empty
        tier_bytes = sum(
            os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".kv")
        )
        if tier_bytes != self.disk.num_blocks * self.bytes_per_block:
            logger.warning(
                "KV offload: persistent disk tier %s: its files are not whole; starting empty", folder
            )
            return
        for block_hash, slot in zip(hashes, slots.tolist(), strict=True):
            self.disk.slot_of[block_hash.tobytes()] = slot
            self._record(MEDIUM_STORAGE, False, block_hash.tobytes())  # routable from the start
        self.disk.num_used = num_used
        logger.info(
            "KV offload: persistent disk tier %s holds %d blocks of an earlier engine", folder, len(slots)
        )

    def _held(self, block_hash: bytes) -> bool:
        return block_hash in self.index or (self.disk is not None and block_hash in self.disk)

    def _record(self, medium: str, is_removal: bool, block_hash: bytes) -> None:
        if self._changes is not None:
            self._changes.append((medium, is_removal, block_hash))

    def _on_host_evict(self, block_hash: bytes, host_slot: int) -> None:
        self._record(MEDIUM_CPU, True, block_hash)
        if self.disk is not None:
            self._demote(block_hash, host_slot)

    def _on_disk_evict(self, block_hash: bytes, disk_slot: int) -> None:
        self._record(MEDIUM_STORAGE, True, block_hash)

    def _allocate_on_disk(self, block_hash: bytes) -> int | None:
        """`disk.allocate`, its store recorded (after the eviction it may make)."""
        disk_slot = self.disk.allocate(block_hash)
        if disk_slot is not None:
            self._record(MEDIUM_STORAGE, False, block_hash)
        return disk_slot

    def _demote(self, block_hash: bytes, host_slot: int) -> None:
        """The host tier evicts `block_hash` from `host_slot`: copy it to the disk tier (unless the disk
        already holds it, or every disk slot is loaded or written this step: then it is dropped, and
        counted: xlaserve:kv_offload_demotions_skipped). The host never evicts a block saved this step
        (its slot is pinned), so the slot holds its bytes."""
        if block_hash in self.disk:
            self.disk.slot_of.move_to_end(block_hash)
            return
        disk_slot = self._allocate_on_disk(block_hash)
        if disk_slot is None:
            self.stats.num_demotes_skipped += 1
        else:
            self._demotes.append((host_slot, disk_slot))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        # Device hits are whole blocks, and the last prompt token is always computed (its logits).
        # Where the device cache serves the request nothing (prompt logprobs), neither does this tier.
        if skips_prefix_cache(request):
            return 0
        first = num_computed_tokens // self.block_size
        max_blocks = (request.num_tokens - 1) // self.block_size
        held = takewhile(self._held, request.block_hashes[first:max_blocks])  # either tier, in order
        return sum(1 for _ in held) * self.block_size

    def update_state_after_alloc(self, request, block_ids, num_computed_tokens, num_external_tokens) -> None:
        self.stats.num_queries += request.num_tokens - num_computed_tokens
        self.stats.num_hits += num_external_tokens
        first = num_computed_tokens // self.block_size
        for index in range(first, first + num_external_tokens // self.block_size):
            block_hash, block_id = request.block_hashes[index], block_ids[index]
            if block_hash in self.index:
                self._loads[block_id] = self.index.take_for_load(block_hash)
                self._disk_loads.pop(block_id, None)
            else:
                self._disk_loads[block_id] = self.disk.take_for_load(block_hash)
                self._loads.pop(block_id, None)
                self.stats.num_disk_hits += self.block_size

    def on_block_evicted(self, block_hash: bytes, block_id: int) -> None:
        # Already held (loaded from a tier, or saved before): touching it is enough.
        if block_hash in self.index:
            self.index.slot_of.move_to_end(block_hash)
        elif self.disk is not None and block_hash in self.disk:
            self.disk.slot_of.move_to_end(block_hash)
        else:
            self._evicted[block_hash] = block_id

    def build_connector_meta(self, scheduled) -> KVConnectorMetadata | None:
        if not scheduled:
            return None  # nothing runs, nothing is overwritten: the saves wait for the next step
        # The slots this step loads or saves are pinned, so a step evicting more blocks than the tier
        # has other slots saves only the last evicted: a finished request's blocks are evicted tail
        # first, and a host hit needs a prefix's first blocks. The others are counted as skipped.
        evicted = list(self._evicted.items())
        room = self.index.num_blocks - len(self.index.pinned)
        num_skipped = max(len(evicted) - room, 0)
        save_ids, save_slots = [], []
        for block_hash, block_id in evicted[num_skipped:]:
            save_ids.append(block_id)
            save_slots.append(self.index.allocate(block_hash))  # may demote
            self._record(MEDIUM_CPU, False, block_hash)
        self.index.unpin_all()
        if self.disk is not None:
            self.disk.unpin_all()
        demotes = np.asarray(self._demotes, np.int32).reshape(-1, 2)
        meta = KVConnectorMetadata(
            save_block_ids=np.asarray(save_ids, np.int32),
            save_slots=np.asarray(save_slots, np.int32),
            load_block_ids=np.fromiter(self._loads.keys(), np.int32, len(self._loads)),
            load_slots=np.fromiter(self._loads.values(), np.int32, len(self._loads)),
            demote_host_slots=demotes[:, 0].copy(),
            demote_disk_slots=demotes[:, 1].copy(),
            disk_load_block_ids=np.fromiter(self._disk_loads.keys(), np.int32, len(self._disk_loads)),
            disk_load_slots=np.fromiter(self._disk_loads.values(), np.int32, len(self._disk_loads)),
        )
        self._evicted, self._loads, self._disk_loads, self._demotes = {}, {}, {}, []
        s = self.stats
        s.num_blocks_saved += len(save_ids)
        s.num_saves_skipped += num_skipped
        s.num_blocks_loaded += len(meta.load_block_ids)
        s.num_blocks_demoted += len(meta.demote_host_slots)
        s.num_blocks_loaded_from_disk += len(meta.disk_load_block_ids)
        s.bytes_saved += len(save_ids) * self.bytes_per_block
        s.bytes_loaded += len(meta.load_block_ids) * self.bytes_per_block
        s.bytes_demoted += len(meta.demote_host_slots) * self.bytes_per_block
        s.bytes_loaded_from_disk += len(meta.disk_load_block_ids) * self.bytes_per_block
        return None if meta.is_empty else meta

    def update_connector_output(self, stats: KVTransferStats | None) -> None:
        if stats is not None:  # the worker's seconds; bytes and blocks are counted here
            self.stats.save_seconds += stats.save_seconds
            self.stats.load_seconds += stats.load_seconds
            self.stats.demote_seconds += stats.demote_seconds
            self.stats.disk_load_seconds += stats.disk_load_seconds

    def make_stats(self) -> KVTransferStats:
        stats, self.stats = self.stats, KVTransferStats()
        stats.offloaded = 1
        return stats

    def take_events(self) -> list[KVCacheEvent]:
        if not self._changes:
            return []
        changes, self._changes = self._changes, []
        return tier_events(changes)

    def reset(self) -> None:
        self.index.clear()
        if self.disk is not None:
            self.disk.clear()
        self._evicted.clear()
        self._demotes.clear()
        if self._changes is not None:  # the device cache's AllBlocksCleared covers what they named
            self._changes.clear()
        self._keep = False  # the blocks computed from here on may be another checkpoint's

    def shutdown_plan(self, cached_blocks: list[tuple[bytes, int]]) -> KVConnectorMetadata | None:
        """A persistent tier's last copies: the host tier's blocks, then the device cache's, that the disk
        does not hold yet, the most recent last; as many as the disk holds, the earlier ones evicted."""
        if not self._keep:
            return None
        self.index.unpin_all()
        self.disk.unpin_all()
        wanted = [(h, True, slot) for h, slot in self.index.slot_of.items() if h not in self.disk]
        wanted += [(h, False, block_id) for h, block_id in cached_blocks if not self._held(h)]
        demotes, saves = [], []
        for block_hash, on_host, source in wanted[max(len(wanted) - self.disk.num_blocks, 0) :]:
            (demotes if on_host else saves).append((source, self._allocate_on_disk(block_hash)))
        demotes = np.asarray(demotes, np.int32).reshape(-1, 2)
        saves = np.asarray(saves, np.int32).reshape(-1, 2)
        meta = KVConnectorMetadata(
            demote_host_slots=demotes[:, 0].copy(),
            demote_disk_slots=demotes[:, 1].copy(),
            disk_save_block_ids=saves[:, 0].copy(),
            disk_save_slots=saves[:, 1].copy(),
        )
        return None if meta.is_empty else meta

    def shut_down(self) -> None:
        """Write the persistent tier's index (its blocks are on disk now) and unlock its directory."""
        if self._lock is None:
            return
        if self._keep:
            hashes = b"".join(self.disk.slot_of.keys())
            tmp = os.path.join(self.persist_dir, "index.tmp.npz")
            np.savez(
                tmp,
                hashes=np.frombuffer(hashes, np.uint8).reshape(-1, HASH_BYTES),
                slots=np.fromiter(self.disk.slot_of.values(), np.int64, len(self.disk)),
                num_used=np.int64(self.disk.num_used),
            )
            os.replace(tmp, os.path.join(self.persist_dir, PERSISTED_INDEX))
            logger.info("KV offload: kept %d blocks in the disk tier %s", len(self.disk), self.persist_dir)
        else:
            logger.info(
                "KV offload: the prefix cache was reset: the disk tier %s keeps nothing", self.persist_dir
            )
        self._lock.close()
        self._lock, self._keep = None, False
