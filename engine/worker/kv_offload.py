"""Host offload, the worker's half: the host tier's bytes, and the copies in and out of the device cache.

The host tier is one numpy array per cache array, [num_host_blocks, num_layers, block_size, ...]: a
host block holds one device block id across every layer. The scheduler's half (core/kv_offload.py)
decides which device blocks go to which host slots and back; this half runs two jitted programs of
fixed shapes, `TRANSFER_CHUNK_BLOCKS` blocks per call (padded with the null block, which padding may
always write), so a step's transfers never compile anything after warm-up:

- save: gather the blocks (all layers) into a new device array, read to the host one step later (by
  then the device has long computed it, so the host seldom waits), and written into their slots;
- load: the slots' bytes `device_put` and scattered into the cache at their block ids (cache donated).

Both run before the step's forward: a block saved is read before the step reuses it, a block loaded
is in place before attention reads it. The bytes are copied as they are (bfloat16, fp8): a block
reloaded is bit-identical to the one evicted. A block leaves the device in one layout whatever the
device cache's (`BlockLayout`): each of the model's KV heads once, its tokens in position order.

A disk tier (`DiskTier`) is the same layout in files under `kv_offloading_disk_path`, memory-mapped:
blocks the host tier evicts are copied there from their host slots (before this step's saves can
land in them), and a disk hit is read from the file into the load program's staging like a host one.
The files are this process's alone, unlinked once mapped: nothing is left on disk after it exits, and
a restarted engine starts with an empty tier. A persistent tier (`kv_offloading_disk_persist`) keeps
them, named, in its directory (core/kv_offload.py `persistent_tier_dir`), reopened by the next engine
of the same settings; at shutdown `keep_blocks` writes the cached blocks to them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import mmap
import os
import shutil
import tempfile
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.config import CacheConfig
from xlaserve.core.kv_connector import KVConnectorMetadata, KVConnectorWorker, KVTransferStats
from xlaserve.core.kv_offload import PERSISTED_INDEX, num_host_blocks

logger = logging.getLogger(__name__)

# Blocks per transfer program call (the programs' fixed shape): a step moving more calls them again.
TRANSFER_CHUNK_BLOCKS = 16


def _cache_rows(block_ids: jax.Array, num_layers: int, num_blocks: int) -> jax.Array:
    """[B] block ids -> [B * L] rows of a cache array (layer l of block b at l * num_blocks + b)."""
    layers = jnp.arange(num_layers, dtype=jnp.int32)
    return (block_ids[:, None] + layers[None, :] * num_blocks).reshape(-1)


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """A block as it leaves the device cache (to a host tier, to a consumer) and comes back: each of the
    model's `kv_heads` once, its tokens in position order, whatever the device layout. The device cache
    (a [L * num_blocks, slots, H, ...] array) may hold more: tensor parallelism wider than the KV heads
    keeps H / kv_heads adjacent copies of each head (sharding/kv_heads.py; under decode context parallel
    an MLA latent is one head a rank), and decode context parallel spreads a block over each group of
    `dcp` consecutive copies, position p at slot p // dcp of the group's copy p % dcp
    (sharding/context_parallel.py). Out, one group of each head's copies is kept and put back in
    position order; in, it is spread again and copied to every group. So a host tier holds no copy
    twice, and a producer and a consumer of different layouts exchange blocks both read.
    `kv_heads` 0: as many as the cache holds (one device, or no copies)."""

    kv_heads: int = 0
    dcp: int = 1

    def _groups(self, cache_heads: int) -> tuple[int, int]:
        """(kv_heads, groups of dcp copies per head) of a cache holding `cache_heads` heads."""
        heads = self.kv_heads or cache_heads
        if cache_heads % (heads * self.dcp):
            raise ValueError(
                f"a cache of {cache_heads} heads holds no {heads} heads x {self.dcp} interleaved"
            )
        return heads, cache_heads // (heads * self.dcp)

    def moved_shape(self, cache_block_shape: tuple[int, ...]) -> tuple[int, ...]:
        """A cache block's [slots, H, ...] -> the moved block's [slots * dcp, kv_heads, ...]."""
        slots, cache_heads, *rest = cache_block_shape
        return (slots * self.dcp, self._groups(cache_heads)[0], *rest)

    def out_of_cache(self, blocks: jax.Array) -> jax.Array:
        """[B, L, slots, H, ...] as the cache holds them -> [B, L, slots * dcp, kv_heads, ...]."""
        b, num_layers, slots, cache_heads, *rest = blocks.shape
        heads, groups = self._groups(cache_heads)
        if heads == cache_heads:  # no copies, so no interleave either: as they are
            return blocks
        first_group = blocks.reshape(b, num_layers, slots, heads, groups, self.dcp, *rest)[:, :, :, :, 0]
        in_order = jnp.moveaxis(first_group, 4, 3)  # [B, L, slots, dcp, heads, ...]: position slot*dcp + g
        return in_order.reshape(b, num_layers, slots * self.dcp, heads, *rest)

    def into_cache(self, blocks: jax.Array, cache_heads: int) -> jax.Array:
        """`out_of_cache`'s inverse: [B, L, slots * dcp, kv_heads, ...] -> [B, L, slots, H, ...]."""
        b, num_layers, length, heads, *rest = blocks.shape
        _, groups = self._groups(cache_heads)
        if heads == cache_heads:
            return blocks
        slots = length // self.dcp
        spread = jnp.moveaxis(blocks.reshape(b, num_layers, slots, self.dcp, heads, *rest), 3, 4)
        copies = jnp.broadcast_to(
            spread[:, :, :, :, None], (b, num_layers, slots, heads, groups, self.dcp, *rest)
        )
        return copies.reshape(b, num_layers, slots, cache_heads, *rest)


# How a connector's cache moves: one layout, or one per cache of a tuple of them (`cache_arrays`).
MovedLayout = BlockLayout | tuple[BlockLayout, ...]


def cache_arrays(kv_cache, layout: MovedLayout) -> list[tuple[jax.Array, BlockLayout]]:
    """Each array a block is moved out of, with the layout it moves in: `kv_cache`'s arrays in one
    `BlockLayout`, or, for a tuple of layouts, a tuple of caches indexed by the same block ids (the
    runner's and a drafter's: worker/kv_plumbing.py), each cache's arrays in its own layout. Every
    array is [L * num_blocks, slots, H, ...] of its own L, so a block moves as one list of arrays
    whatever caches hold its rows."""
    if isinstance(layout, BlockLayout):
        return [(a, layout) for a in jax.tree.leaves(kv_cache)]
    return [(a, lay) for cache, lay in zip(kv_cache, layout, strict=True) for a in jax.tree.leaves(cache)]


def _gather_blocks(num_blocks: int, layout: MovedLayout, kv_cache, block_ids):
    """-> one [B, L, block_size, kv_heads, ...] array per cache array (`cache_arrays`): the blocks' K/V
    in every layer, moved out of the cache's layout (`BlockLayout`)."""
    gathered = []
    for a, lay in cache_arrays(kv_cache, layout):
        num_layers = a.shape[0] // num_blocks
        rows = _cache_rows(block_ids, num_layers, num_blocks)
        gathered.append(lay.out_of_cache(a[rows].reshape(block_ids.shape[0], num_layers, *a.shape[1:])))
    return tuple(gathered)


def _scatter_blocks(num_blocks: int, layout: MovedLayout, kv_cache, block_ids, blocks):
    """`kv_cache` with `blocks` (as `_gather_blocks` returns them) written at `block_ids`."""
    new = []
    for (a, lay), b in zip(cache_arrays(kv_cache, layout), blocks, strict=True):
        rows = _cache_rows(block_ids, a.shape[0] // num_blocks, num_blocks)
        new.append(a.at[rows].set(lay.into_cache(b, a.shape[2]).reshape(-1, *a.shape[1:]).astype(a.dtype)))
    return jax.tree.unflatten(jax.tree.structure(kv_cache), new)


def transfer_programs(kv_cache, num_blocks: int, layout: MovedLayout):
    """(gather, scatter), jitted for `kv_cache`'s layout (`cache_arrays`): gather(cache, ids) ->
    `_gather_blocks`'s arrays; scatter(cache, ids, blocks) -> the cache (donated) with the blocks written,
    placed as it was."""
    shardings = jax.tree.map(lambda a: a.sharding, kv_cache)
    gather = jax.jit(lambda cache, ids: _gather_blocks(num_blocks, layout, cache, ids))
    scatter = jax.jit(
        lambda cache, ids, blocks: _scatter_blocks(num_blocks, layout, cache, ids, blocks),
        donate_argnums=0,
        out_shardings=shardings,
    )
    return gather, scatter


def _host_array(shape: tuple[int, ...], dtype) -> np.ndarray:
    """Zeroed host memory, its pages faulted in now rather than by the saves that first write them
    (measured here: first writes at 0.24 GB/s, rewrites at 15 GB/s), on transparent huge pages where the
    OS offers them (a third of the faulting time)."""
    dtype = np.dtype(dtype)
    num_bytes = max(int(np.prod(shape)) * dtype.itemsize, 1)
    memory = mmap.mmap(-1, num_bytes)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            memory.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(memory, np.uint8, count=num_bytes)
    raw[:] = 0  # fault every page in
    return raw[: int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)


class DiskTier:
    """`num_blocks` blocks in files under `path`, one memory-mapped array per cache array (as the host
    tier's: [num_blocks, L, block_size, ...]), created at the first use (when the shapes are known).
    `persist_dir`: a persistent tier's files, `name` + the array's number + ".kv", kept (and reopened
    where they exist whole)."""

    def __init__(self, path: str, num_blocks: int, persist_dir: str | None = None, name: str = ""):
        self.path = path
        self.num_blocks = num_blocks
        self.persist_dir = persist_dir
        self.name = name
        self.arrays: list[np.ndarray] | None = None

    def ensure(self, shapes_dtypes) -> None:
        if self.arrays is not None:
            return
        t0 = time.perf_counter()
        self.arrays = [
            self._map((self.num_blocks, *shape[1:]), np.dtype(dtype), i)
            for i, (shape, dtype) in enumerate(shapes_dtypes)
        ]
        logger.info(
            "KV offload: disk tier of %d blocks (%.1f MiB) under %s in %.2f s",
            self.num_blocks,
            self.nbytes / 2**20,
            self.path,
            time.perf_counter() - t0,
        )

    def _map(self, shape: tuple[int, ...], dtype: np.dtype, number: int) -> np.ndarray:
        if self.persist_dir is not None:
            os.makedirs(self.persist_dir, exist_ok=True)
            name = os.path.join(self.persist_dir, f"{self.name}{number}.kv")
            if os.path.exists(name) and os.path.getsize(name) == math.prod(shape) * dtype.itemsize:
                return np.memmap(name, dtype=dtype, mode="r+", shape=shape)
            # A new file: an index kept beside the old ones (if the scheduler's half has not taken it
            # yet) no longer describes it.
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.persist_dir, PERSISTED_INDEX))
            return np.memmap(name, dtype=dtype, mode="w+", shape=shape)
        with tempfile.NamedTemporaryFile(dir=self.path, prefix="xlaserve-kv-", delete=False) as f:
            name = f.name
        try:
            return np.memmap(name, dtype=dtype, mode="w+", shape=shape)
        finally:
            os.unlink(name)  # the mapping stays; the file goes with the process

    @property
    def nbytes(self) -> int:
        return 0 if self.arrays is None else sum(a.nbytes for a in self.arrays)


def padded_ids(ids: np.ndarray) -> np.ndarray:
    out = np.zeros(TRANSFER_CHUNK_BLOCKS, np.int32)  # block 0: the null block
    out[: len(ids)] = ids
    return out


class BlockTransferWorker(KVConnectorWorker):
    """What a connector that moves whole blocks has: the gather and scatter programs over the cache
    (`transfer_programs`, built on first use), compiled by `warm_up` on the null block, and the chunked
    gather and scatter (`gather_chunks`, `scatter_chunks`). Host offload and disaggregated prefill
    (worker/kv_transfer.py) build on it."""

    def __init__(self, num_blocks: int, layout: MovedLayout):
        self.num_blocks = num_blocks  # the device cache's, null block included
        self.layout = layout
        self._gather_fn = self._scatter_fn = None

    def _programs(self, kv_cache) -> None:
        if self._gather_fn is None:
            self._gather_fn, self._scatter_fn = transfer_programs(kv_cache, self.num_blocks, self.layout)

    def gather_chunks(self, kv_cache, block_ids: np.ndarray) -> Iterator[tuple[int, tuple[jax.Array, ...]]]:
        """(start, blocks) per gather program call: block_ids[start : start + TRANSFER_CHUNK_BLOCKS]
        (padded with the null block), one array per cache array, their copies to the host started as the
        call is dispatched (overlapping whatever the device runs next). A generator: a caller that writes
        each call's blocks out before taking the next holds one call's on the device, not all of them."""
        self._programs(kv_cache)
        for start in range(0, len(block_ids), TRANSFER_CHUNK_BLOCKS):
            gathered = self._gather_fn(kv_cache, padded_ids(block_ids[start : start + TRANSFER_CHUNK_BLOCKS]))
            for array in gathered:
                array.copy_to_host_async()
            yield start, gathered

    def scatter_chunks(self, kv_cache, block_ids: np.ndarray, sources: list[np.ndarray], rows=None):
        """`kv_cache` with `block_ids` filled from `sources`, one per cache array, each row one block as
        it leaves a cache (`chunk_shapes`): a host or disk tier's `rows` (None: its first rows, in order:
        a producer's blocks). A scatter program call per TRANSFER_CHUNK_BLOCKS blocks (padded with the
        null block), each waiting for its blocks' copy to the device, so a load's seconds measure the
        copies rather than the dispatch."""
        self._programs(kv_cache)
        for start in range(0, len(block_ids), TRANSFER_CHUNK_BLOCKS):
            ids = block_ids[start : start + TRANSFER_CHUNK_BLOCKS]
            taken = slice(start, start + len(ids)) if rows is None else rows[start : start + len(ids)]
            blocks = []
            for source in sources:
                staged = np.zeros((TRANSFER_CHUNK_BLOCKS, *source.shape[1:]), source.dtype)
                staged[: len(ids)] = source[taken]
                blocks.append(jax.device_put(staged))
            jax.block_until_ready(blocks)
            kv_cache = self._scatter_fn(kv_cache, padded_ids(ids), tuple(blocks))
        return kv_cache

    def chunk_shapes(self, kv_cache) -> list[tuple[tuple[int, ...], np.dtype]]:
        """Shape and dtype of one program call's blocks per cache array, as they leave the device:
        [chunk, L, block_size, kv_heads, ...] (`BlockLayout`)."""
        return [
            (
                (TRANSFER_CHUNK_BLOCKS, a.shape[0] // self.num_blocks, *lay.moved_shape(a.shape[1:])),
                np.dtype(a.dtype),
            )
            for a, lay in cache_arrays(kv_cache, self.layout)
        ]

    def warm_up(self, kv_cache):
        """Run both programs once on the null block, compiling them (`_before_warm_up` first)."""
        self._programs(kv_cache)
        ids = padded_ids(np.zeros(0, np.int32))
        shapes = self.chunk_shapes(kv_cache)
        self._before_warm_up(shapes)
        # Twice: the second call, and the gather, see the cache as every step leaves it (a program's
        # output, placed by its out_shardings), which a freshly allocated cache may not be.
        for _ in range(2):
            kv_cache = self._scatter_fn(kv_cache, ids, tuple(jax.device_put(np.zeros(*s)) for s in shapes))
        jax.block_until_ready(self._gather_fn(kv_cache, ids))
        return kv_cache

    def _before_warm_up(self, shapes) -> None:
        """What a subclass sizes from the programs' shapes before they compile."""


class OffloadingConnectorWorker(BlockTransferWorker):
    """The host tier's arrays and the two transfer programs."""

    def __init__(
        self, num_host_blocks: int, num_blocks: int, layout: MovedLayout, disk: DiskTier | None = None
    ):
        super().__init__(num_blocks, layout)
        self.stats = KVTransferStats()
        self.num_host_blocks = num_host_blocks
        self.host: list[np.ndarray] | None = None  # per cache array [num_host_blocks, L, block_size, ...]
        self.disk = disk
        # Gathers dispatched, not yet on the host: (device arrays, host slots).
        self._pending: list[tuple[tuple[jax.Array, ...], np.ndarray]] = []

    def _ensure_host(self, shapes_dtypes) -> None:
        if self.host is None:
            t0 = time.perf_counter()
            self.host = [_host_array((self.num_host_blocks, *s[1:]), dtype) for s, dtype in shapes_dtypes]
            if self.disk is not None:
                self.disk.ensure(shapes_dtypes)
            logger.info(
                "KV offload: host tier of %d blocks (%.1f MiB) in %.2f s",
                self.num_host_blocks,
                self.host_bytes / 2**20,
                time.perf_counter() - t0,
            )

    def take_stats(self) -> KVTransferStats:
        stats, self.stats = self.stats, KVTransferStats()
        return stats

    @property
    def host_bytes(self) -> int:
        return 0 if self.host is None else sum(a.nbytes for a in self.host)

    def save_kv(self, kv_cache, metadata: KVConnectorMetadata | None) -> None:
        self.flush()  # the previous steps' saves land first: this step's loads may read them
        if metadata is not None and len(metadata.demote_host_slots):
            self._demote(metadata.demote_host_slots, metadata.demote_disk_slots)
        if metadata is None or not len(metadata.save_block_ids):
            return
        for start, gathered in self.gather_chunks(kv_cache, metadata.save_block_ids):
            self._pending.append((gathered, metadata.save_slots[start : start + TRANSFER_CHUNK_BLOCKS]))

    def flush(self) -> None:
        """Bring every gathered block to its host slot (blocks until the gathers are computed)."""
        if not self._pending:
            return
        t0 = time.perf_counter()
        for arrays, slots in self._pending:
            host_arrays = [np.asarray(a) for a in arrays]
            self._ensure_host([(a.shape, a.dtype) for a in host_arrays])
            for buffer, blocks in zip(self.host, host_arrays):
                buffer[slots] = blocks[: len(slots)]
        self._pending = []
        self.stats.save_seconds += time.perf_counter() - t0

    def keep_blocks(self, kv_cache, metadata: KVConnectorMetadata) -> None:
        """A persistent tier's shutdown: host slots and device blocks to their disk slots, on disk when
        this returns."""
        self.flush()
        if len(metadata.demote_host_slots):
            self._demote(metadata.demote_host_slots, metadata.demote_disk_slots)
        ids_all, slots_all = metadata.disk_save_block_ids, metadata.disk_save_slots
        if len(ids_all):
            self.disk.ensure(self.chunk_shapes(kv_cache))
            for start, gathered in self.gather_chunks(kv_cache, ids_all):
                slots = slots_all[start : start + TRANSFER_CHUNK_BLOCKS]
                for disk, blocks in zip(self.disk.arrays, gathered):
                    disk[slots] = np.asarray(blocks)[: len(slots)]
        for disk in self.disk.arrays or ():
            disk.flush()

    def _demote(self, host_slots: np.ndarray, disk_slots: np.ndarray) -> None:
        """Host slots -> disk slots (blocks the host tier evicts), before saves reuse the host slots."""
        assert self.host is not None and self.disk is not None, "a demotion without both tiers"
        t0 = time.perf_counter()
        for host, disk in zip(self.host, self.disk.arrays):
            disk[disk_slots] = host[host_slots]
        self.stats.demote_seconds += time.perf_counter() - t0

    def load_kv(self, kv_cache, metadata: KVConnectorMetadata | None):
        if metadata is None:
            return kv_cache
        if len(metadata.load_block_ids):
            assert self.host is not None, "a load from a host tier nothing was saved to"
            t0 = time.perf_counter()
            kv_cache = self.scatter_chunks(kv_cache, metadata.load_block_ids, self.host, metadata.load_slots)
            self.stats.load_seconds += time.perf_counter() - t0
        if len(metadata.disk_load_block_ids):
            assert self.disk is not None, "a load from no disk tier"
            self.disk.ensure(self.chunk_shapes(kv_cache))  # a persistent tier's first use may be a load
            t0 = time.perf_counter()
            kv_cache = self.scatter_chunks(
                kv_cache, metadata.disk_load_block_ids, self.disk.arrays, metadata.disk_load_slots
            )
            self.stats.disk_load_seconds += time.perf_counter() - t0
        return kv_cache

    def _before_warm_up(self, shapes) -> None:
        self._ensure_host(shapes)  # the host tier sized by the programs' blocks


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none: not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def disk_tier_blocks(cache: CacheConfig, bytes_per_block: int) -> int:
    """The disk tier's blocks; ValueError naming the field for a path that is not a writable directory
    or a size past its free space."""
    path = cache.kv_offloading_disk_path
    if not os.path.isdir(path) or not os.access(path, os.W_OK):
        raise ValueError(f"kv_offloading_disk_path ({path!r}) must be a writable directory")
    num_disk = num_host_blocks(cache.disk_tier_size, bytes_per_block, "kv_offloading_disk_size")
    free = shutil.disk_usage(path).free
    if num_disk * bytes_per_block > free:
        raise ValueError(
            f"kv_offloading_disk_size ({cache.disk_tier_size} GiB) is more than the free space under "
            f"{path!r} ({free / 2**30:.1f} GiB); lower it"
        )
    return num_disk
