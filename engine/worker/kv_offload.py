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
reloaded is bit-identical to the one evicted.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import time

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.config import CacheConfig
from xlaserve.core.kv_connector import KVConnectorMetadata, KVConnectorWorker, KVTransferStats
from xlaserve.core.kv_offload import num_host_blocks

logger = logging.getLogger(__name__)

# Blocks per transfer program call (the programs' fixed shape): a step moving more calls them again.
TRANSFER_CHUNK_BLOCKS = 16


def _cache_rows(block_ids: jax.Array, num_layers: int, num_blocks: int) -> jax.Array:
    """[B] block ids -> [B * L] rows of a cache array (layer l of block b at l * num_blocks + b)."""
    layers = jnp.arange(num_layers, dtype=jnp.int32)
    return (block_ids[:, None] + layers[None, :] * num_blocks).reshape(-1)


def _gather_blocks(num_blocks: int, kv_cache, block_ids):
    """-> one [B, L, block_size, ...] array per cache array: the blocks' K/V in every layer."""
    leaves = jax.tree.leaves(kv_cache)
    num_layers = leaves[0].shape[0] // num_blocks
    rows = _cache_rows(block_ids, num_layers, num_blocks)
    return tuple(a[rows].reshape(block_ids.shape[0], num_layers, *a.shape[1:]) for a in leaves)


def _scatter_blocks(num_blocks: int, kv_cache, block_ids, blocks):
    """`kv_cache` with `blocks` (as `_gather_blocks` returns them) written at `block_ids`."""
    leaves, treedef = jax.tree.flatten(kv_cache)
    num_layers = leaves[0].shape[0] // num_blocks
    rows = _cache_rows(block_ids, num_layers, num_blocks)
    new = [a.at[rows].set(b.reshape(-1, *a.shape[1:]).astype(a.dtype)) for a, b in zip(leaves, blocks)]
    return jax.tree.unflatten(treedef, new)


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


def _padded(ids: np.ndarray) -> np.ndarray:
    out = np.zeros(TRANSFER_CHUNK_BLOCKS, np.int32)  # block 0: the null block
    out[: len(ids)] = ids
    return out


class OffloadingConnectorWorker(KVConnectorWorker):
    """The host tier's arrays and the two transfer programs."""

    def __init__(self, num_host_blocks: int, num_blocks: int):
        self.num_host_blocks = num_host_blocks
        self.num_blocks = num_blocks  # the device cache's, null block included
        self.host: list[np.ndarray] | None = None  # per cache array [num_host_blocks, L, block_size, ...]
        # Gathers dispatched, not yet on the host: (device arrays, host slots).
        self._pending: list[tuple[tuple[jax.Array, ...], np.ndarray]] = []
        self._gather_fn = self._scatter_fn = None
        self.stats = KVTransferStats()

    def _programs(self, kv_cache) -> None:
        if self._gather_fn is not None:
            return
        shardings = jax.tree.map(lambda a: a.sharding, kv_cache)
        self._gather_fn = jax.jit(lambda cache, ids: _gather_blocks(self.num_blocks, cache, ids))
        self._scatter_fn = jax.jit(
            lambda cache, ids, blocks: _scatter_blocks(self.num_blocks, cache, ids, blocks),
            donate_argnums=0,
            out_shardings=shardings,
        )

    def _ensure_host(self, shapes_dtypes) -> None:
        if self.host is None:
            t0 = time.perf_counter()
            self.host = [_host_array((self.num_host_blocks, *s[1:]), dtype) for s, dtype in shapes_dtypes]
            logger.info(
                "KV offload: host tier of %d blocks (%.1f MiB) in %.2f s",
                self.num_host_blocks,
                self.host_bytes / 2**20,
                time.perf_counter() - t0,
            )

    @property
    def host_bytes(self) -> int:
        return 0 if self.host is None else sum(a.nbytes for a in self.host)

    def save_kv(self, kv_cache, metadata: KVConnectorMetadata | None) -> None:
        self.flush()  # the previous steps' saves land first: this step's loads may read them
        if metadata is None or not len(metadata.save_block_ids):
            return
        self._programs(kv_cache)
        for start in range(0, len(metadata.save_block_ids), TRANSFER_CHUNK_BLOCKS):
            ids = metadata.save_block_ids[start : start + TRANSFER_CHUNK_BLOCKS]
            slots = metadata.save_slots[start : start + TRANSFER_CHUNK_BLOCKS]
            gathered = self._gather_fn(kv_cache, _padded(ids))
            for array in gathered:  # the copy to the host starts now, overlapping the step
                array.copy_to_host_async()
            self._pending.append((gathered, slots))

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

    def load_kv(self, kv_cache, metadata: KVConnectorMetadata | None):
        if metadata is None or not len(metadata.load_block_ids):
            return kv_cache
        assert self.host is not None, "a load from a host tier nothing was saved to"
        self._programs(kv_cache)
        t0 = time.perf_counter()
        for start in range(0, len(metadata.load_block_ids), TRANSFER_CHUNK_BLOCKS):
            ids = metadata.load_block_ids[start : start + TRANSFER_CHUNK_BLOCKS]
            slots = metadata.load_slots[start : start + TRANSFER_CHUNK_BLOCKS]
            blocks = []
            for buffer in self.host:
                staged = np.zeros((TRANSFER_CHUNK_BLOCKS, *buffer.shape[1:]), buffer.dtype)
                staged[: len(slots)] = buffer[slots]
                blocks.append(jax.device_put(staged))
            jax.block_until_ready(blocks)  # the copy is what load_seconds measures, not the scatter
            kv_cache = self._scatter_fn(kv_cache, _padded(ids), tuple(blocks))
        self.stats.load_seconds += time.perf_counter() - t0
        return kv_cache

    def take_stats(self) -> KVTransferStats:
        stats, self.stats = self.stats, KVTransferStats()
        return stats

    def warm_up(self, kv_cache):
        """Run both programs once on the null block (compiling them), and size the host tier."""
        self._programs(kv_cache)
        ids = _padded(np.zeros(0, np.int32))
        leaves = jax.tree.leaves(kv_cache)
        num_layers = leaves[0].shape[0] // self.num_blocks
        shapes = [((TRANSFER_CHUNK_BLOCKS, num_layers, *a.shape[1:]), np.dtype(a.dtype)) for a in leaves]
        self._ensure_host(shapes)
        # Twice: the second call, and the gather, see the cache as every step leaves it (a program's
        # output, placed by its out_shardings), which a freshly allocated cache may not be.
        for _ in range(2):
            kv_cache = self._scatter_fn(kv_cache, ids, tuple(jax.device_put(np.zeros(*s)) for s in shapes))
        jax.block_until_ready(self._gather_fn(kv_cache, ids))
        return kv_cache


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


def make_kv_connector_worker(cache: CacheConfig, bytes_per_block: int, num_blocks: int) -> KVConnectorWorker:
    """The worker's half of the configured connector: host offload, or the base class (off). A host tier
    larger than the memory available now is a ValueError naming the field, not an OOM kill mid-start."""
    if cache.kv_offloading_size is None:
        return KVConnectorWorker()
    num_host = num_host_blocks(cache.kv_offloading_size, bytes_per_block)
    available = available_host_bytes()
    if available is not None and num_host * bytes_per_block > available:
        raise ValueError(
            f"kv_offloading_size ({cache.kv_offloading_size} GiB) is more than the host memory available "
            f"({available / 2**30:.1f} GiB); lower it"
        )
    return OffloadingConnectorWorker(num_host, num_blocks)
