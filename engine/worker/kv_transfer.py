"""Disaggregated prefill, the worker's half: a producer's block server, a consumer's loads
(core/kv_transfer.py has the flow and the wire).

A producer gathers each send's blocks (all layers) right after the forward that completes the prompt,
in `TRANSFER_CHUNK_BLOCKS`-block calls of the offload's gather program, and starts their copy to the
host; its block server (a thread with a ZMQ ROUTER on `kv_ip:kv_port`) brings them to the host when a
consumer first asks, and answers chunk by chunk. A consumer's loads arrive with their bytes in the
step's metadata and are scattered into the cache before the forward, as host offload's are. The bytes
are the cache's own (bfloat16, fp8): a block loaded is bit-identical to the one the producer computed,
and the two sides may lay the cache out differently (tensor and context parallelism): the gather brings
each block to the host as one device holds it (worker/kv_offload.BlockLayout), the scatter places it as
the consumer's cache is laid out and placed. On pipeline stages each stage gathers and scatters its
own layers, and a block crosses the wire as the whole model's layers (`DisaggConnectorWorker`), so the
two sides may have different numbers of stages too.

This module also builds the configured connector's worker half (`make_kv_connector_worker`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field

import jax
import numpy as np
import zmq

from xlaserve.config import CacheConfig, KVTransferConfig
from xlaserve.core.kv_connector import KVConnectorMetadata, KVConnectorWorker, KVTransferStats
from xlaserve.core.kv_multi_connector import MultiConnectorWorker
from xlaserve.core.kv_offload import num_host_blocks
from xlaserve.core.kv_transfer import GET, encode_header
from xlaserve.worker.kv_offload import (
    BlockLayout,
    BlockTransferWorker,
    DiskTier,
    MovedLayout,
    OffloadingConnectorWorker,
    available_host_bytes,
    disk_tier_blocks,
)

logger = logging.getLogger(__name__)

_POLL_MS = 100


@dataclass
class _Send:
    """One request's blocks, gathered on the device; on the host once a consumer first asks."""

    num_blocks: int
    digest: str
    created: float
    # Per cache (pipeline stages: each stage's, in layer order), per gather call, per cache array.
    gathered: list[list[tuple[jax.Array, ...]]] = field(default_factory=list)
    rows: list[np.ndarray] | None = None  # per cache array [num_blocks, bytes per block] uint8

    def host_rows(self) -> list[np.ndarray]:
        if self.rows is None:
            per_cache = [self._cache_rows(calls) for calls in self.gathered]
            # A row is [L, block_size, ...] in C order, so the stages' rows side by side are the whole
            # model's layers, as one engine without stages sends them.
            self.rows = [parts[0] if len(parts) == 1 else np.hstack(parts) for parts in zip(*per_cache)]
            self.gathered = []
        return self.rows

    def _cache_rows(self, calls: list[tuple[jax.Array, ...]]) -> list[np.ndarray]:
        rows = []
        for parts in zip(*calls):
            blocks = np.concatenate([np.asarray(p) for p in parts])[: self.num_blocks]
            rows.append(np.ascontiguousarray(blocks).view(np.uint8).reshape(self.num_blocks, -1))
        return rows


class BlockServer:
    """A producer's sends, served to consumers from a ZMQ ROUTER on its own thread."""

    def __init__(self, config: KVTransferConfig, block_size: int):
        self.config = config
        self.block_size = block_size
        self._sends: dict[str, _Send] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        address = f"tcp://{config.kv_ip}:{config.kv_port}"
        try:
            self._socket.bind(address)
        except zmq.ZMQError as e:
            self._socket.close()
            raise ValueError(
                f"kv_transfer_config: cannot serve KV blocks on {address} (kv_ip, kv_port): {e}"
            ) from None
        self._thread = threading.Thread(target=self._serve, name="xlaserve-kv-server", daemon=True)
        self._thread.start()
        logger.info("disaggregated prefill: serving KV blocks on %s", address)

    def add(self, request_id: str, send: _Send) -> None:
        with self._lock:
            self._sends[request_id] = send

    def __len__(self) -> int:
        with self._lock:
            return len(self._sends)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(_POLL_MS):
                    frames = self._socket.recv_multipart()
                    try:
                        answer = self._answer(frames[1:])
                    except Exception as e:  # noqa: BLE001 - one bad request never stops the server
                        logger.exception("disaggregated prefill: a block request failed")
                        answer = [encode_header(status="error", error=f"the producer failed: {e}")]
                    self._socket.send_multipart([frames[0], *answer])
                self._to_host()
                self._expire()
        finally:
            self._socket.close()

    def _to_host(self) -> None:
        """Bring gathered sends to the host between requests, so none holds device memory while it
        waits for its consumer (the copies started after their step: this seldom waits)."""
        with self._lock:
            pending = [s for s in self._sends.values() if s.rows is None]
        for send in pending:
            send.host_rows()

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        try:
            if len(frames) not in (4, 5) or frames[0] != GET:
                raise ValueError(f"{len(frames)} frames")
            request_id, digest, chunk = frames[1].decode(), frames[2].decode(), int(frames[3])
            first_block = int(frames[4]) if len(frames) == 5 else 0
            if chunk < 0 or first_block < 0:
                raise ValueError(f"chunk {chunk}, first block {first_block}")
        except (ValueError, UnicodeDecodeError) as e:
            return [encode_header(status="error", error=f"malformed request: {e}")]
        with self._lock:
            send = self._sends.get(request_id)
        if send is None:
            return [encode_header(status="missing", error=f"no blocks held for request {request_id!r}")]
        if send.digest != digest:
            return [encode_header(status="mismatch", error="the prompt differs from the one prefilled")]
        rows = send.host_rows()
        per_chunk = self.config.chunk_blocks
        first_block = min(first_block, send.num_blocks)  # all of them: the consumer had them, none sent
        num_chunks = max(1, -(-(send.num_blocks - first_block) // per_chunk))
        start = min(first_block + chunk * per_chunk, send.num_blocks)
        stop = min(start + per_chunk, send.num_blocks)
        if chunk + 1 >= num_chunks:  # the last chunk: the consumer has everything
            with self._lock:
                self._sends.pop(request_id, None)
        header = encode_header(
            status="ok",
            num_blocks=send.num_blocks,
            num_chunks=num_chunks,
            block_size=self.block_size,
            block_bytes=[r.shape[1] for r in rows],
        )
        return [header, *(memoryview(r[start:stop]) for r in rows)]

    def _expire(self) -> None:
        deadline = time.monotonic() - self.config.send_ttl_s
        with self._lock:
            stale = [rid for rid, s in self._sends.items() if s.created < deadline]
            for rid in stale:
                del self._sends[rid]
        if stale:
            logger.warning("disaggregated prefill: blocks of %d request(s) expired unfetched", len(stale))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


class _CacheBlocks(BlockTransferWorker):
    """The gather and scatter programs over one cache (on pipeline stages, one stage's)."""

    def row_bytes(self, kv_cache) -> list[int]:
        """Bytes of one block of each cache array, as it leaves the device."""
        return [math.prod(shape[1:]) * dtype.itemsize for shape, dtype in self.chunk_shapes(kv_cache)]

    def scatter(self, kv_cache, block_ids: np.ndarray, rows: list[np.ndarray]):
        """`kv_cache` with a producer's rows (per cache array [J, bytes per block] uint8) at `block_ids`."""
        # As blocks leave a cache: [J, L, block_size, kv_heads, ...] (`BlockLayout`).
        blocks = [
            r.view(dtype).reshape(len(r), *shape[1:])
            for r, (shape, dtype) in zip(rows, self.chunk_shapes(kv_cache), strict=True)
        ]
        return self.scatter_chunks(kv_cache, block_ids, blocks)


class DisaggConnectorWorker(KVConnectorWorker):
    """Disaggregated prefill's worker half over the runner's cache, or on `num_stages` pipeline stages over
    the list of the stages' caches (worker/pipeline_runner.py; all on this host: EngineConfig refuses
    nnodes > 1). One block server an engine, and its blocks are the whole model's layers whatever the
    stages: each stage gathers its layers' blocks and `_Send` joins them along the layer axis; a fetched
    block is split by the stages' layers, each part scattered into its stage's cache. So engines of
    different pipeline sizes exchange blocks, as engines of different tensor and context parallel layouts
    do (`BlockLayout`)."""

    def __init__(
        self,
        config: KVTransferConfig,
        num_blocks: int,
        block_size: int,
        layout: MovedLayout,
        num_stages: int = 0,
    ):
        self.config = config
        self.num_stages = num_stages  # 0: no stages, the cache is the runner's one
        self.caches = [_CacheBlocks(num_blocks, layout) for _ in range(max(num_stages, 1))]
        self.server = BlockServer(config, block_size) if config.is_producer else None
        self.stats = KVTransferStats()

    def _per_cache(self, kv_cache) -> list:
        return kv_cache if self.num_stages else [kv_cache]

    def _as_given(self, caches: list):
        return caches if self.num_stages else caches[0]

    def save_kv_after_forward(self, kv_cache, metadata: KVConnectorMetadata | None) -> None:
        if metadata is None or not metadata.sends:
            return
        t0 = time.perf_counter()
        for request_id, block_ids, digest in metadata.sends:
            send = _Send(len(block_ids), digest, time.monotonic())
            send.gathered = [
                [blocks for _, blocks in c.gather_chunks(cache, block_ids)]
                for c, cache in zip(self.caches, self._per_cache(kv_cache))
            ]
            self.server.add(request_id, send)
        self.stats.send_seconds += time.perf_counter() - t0

    def load_kv(self, kv_cache, metadata: KVConnectorMetadata | None):
        if metadata is None or not len(metadata.inline_load_block_ids):
            return kv_cache
        t0 = time.perf_counter()
        loaded, start = [], np.zeros(len(metadata.inline_blocks), np.int64)
        for c, cache in zip(self.caches, self._per_cache(kv_cache), strict=True):
            stop = start + c.row_bytes(cache)  # this cache's layers: the next bytes of each row
            rows = [r[:, a:b] for r, a, b in zip(metadata.inline_blocks, start, stop, strict=True)]
            loaded.append(c.scatter(cache, metadata.inline_load_block_ids, rows))
            start = stop
        self.stats.remote_load_seconds += time.perf_counter() - t0
        return self._as_given(loaded)

    def take_stats(self) -> KVTransferStats:
        stats, self.stats = self.stats, KVTransferStats()
        return stats

    def warm_up(self, kv_cache):
        return self._as_given([c.warm_up(cache) for c, cache in zip(self.caches, self._per_cache(kv_cache))])

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def make_kv_connector_worker(
    cache: CacheConfig,
    bytes_per_block: int,
    num_blocks: int,
    layout: MovedLayout = BlockLayout(),
    persist_dir: str | None = None,
    tier_name: str = "",
    local_stages: list[bool] | None = None,
    kv_transfer: KVTransferConfig | None = None,
) -> KVConnectorWorker:
    """The worker's half of the configured connector: host offload's, disaggregated prefill's, both
    composed (in core/kv_transfer.py's `make_kv_connector_scheduler` order), or the base class (off),
    moving blocks in `layout`, of `bytes_per_block` bytes. `persist_dir`: a persistent disk tier's
    directory (core/kv_offload.py), its files named `tier_name` + a number. On pipeline stages
    (`local_stages`: per stage, whether this process runs it; the cache is the runner's list of the
    stages' caches), host offload's half is one worker per local stage (`StagedKVConnector`; stage i's
    files named `tier_name` + "stage{i}-" + a number), disaggregated prefill's one over all the stages (it
    runs on one host). `kv_transfer`: this data-parallel rank's disaggregated prefill
    (EngineConfig.kv_transfer: its own block server port; None: off)."""
    workers: list[KVConnectorWorker] = []
    if cache.kv_offloading_size is not None:
        if local_stages is None:
            workers.append(
                _offloading_worker(cache, bytes_per_block, num_blocks, layout, persist_dir, tier_name)
            )
        else:
            workers.append(
                StagedKVConnector(
                    [
                        _offloading_worker(
                            cache, bytes_per_block, num_blocks, layout, persist_dir, f"{tier_name}stage{i}-"
                        )
                        if is_local
                        else None
                        for i, is_local in enumerate(local_stages)
                    ]
                )
            )
    if kv_transfer is not None:
        num_stages = 0 if local_stages is None else len(local_stages)
        workers.append(DisaggConnectorWorker(kv_transfer, num_blocks, cache.block_size, layout, num_stages))
    if len(workers) > 1:
        return MultiConnectorWorker(workers)
    return workers[0] if workers else KVConnectorWorker()


def _offloading_worker(
    cache: CacheConfig,
    bytes_per_block: int,
    num_blocks: int,
    layout: MovedLayout,
    persist_dir: str | None,
    tier_name: str,
) -> OffloadingConnectorWorker:
    """Host offload's worker half. A host tier larger than the memory available now is a ValueError
    naming the field, not an OOM kill mid-start."""
    num_host = num_host_blocks(cache.kv_offloading_size, bytes_per_block)
    available = available_host_bytes()
    if available is not None and num_host * bytes_per_block > available:
        raise ValueError(
            f"kv_offloading_size ({cache.kv_offloading_size} GiB) is more than the host memory available "
            f"({available / 2**30:.1f} GiB); lower it"
        )
    disk = None
    if cache.kv_offloading_disk_path is not None:
        disk = DiskTier(
            cache.kv_offloading_disk_path, disk_tier_blocks(cache, bytes_per_block), persist_dir, tier_name
        )
    return OffloadingConnectorWorker(num_host, num_blocks, layout, disk)


class StagedKVConnector(KVConnectorWorker):
    """Host offload on pipeline stages (worker/pipeline_runner.py): a worker half per stage (None: another
    process's stage), each over that stage's cache in the runner's list of them, all given the step's one
    plan (block ids and host slots are the same on every stage). Disaggregated prefill's stages share one
    block server instead (`DisaggConnectorWorker`)."""

    def __init__(self, workers: list[KVConnectorWorker | None]):
        self.workers = workers

    def save_kv(self, kv_cache: list, metadata: KVConnectorMetadata | None) -> None:
        for worker, cache in zip(self.workers, kv_cache, strict=True):
            if worker is not None:
                worker.save_kv(cache, metadata)

    def load_kv(self, kv_cache: list, metadata: KVConnectorMetadata | None) -> list:
        return [
            cache if worker is None else worker.load_kv(cache, metadata)
            for worker, cache in zip(self.workers, kv_cache, strict=True)
        ]

    def save_kv_after_forward(self, kv_cache: list, metadata: KVConnectorMetadata | None) -> None:
        for worker, cache in zip(self.workers, kv_cache, strict=True):
            if worker is not None:
                worker.save_kv_after_forward(cache, metadata)

    def take_stats(self) -> KVTransferStats | None:
        """The stages' seconds added up (their copies run one after another on the host)."""
        return KVTransferStats.total([w.take_stats() for w in self.workers if w is not None])

    def warm_up(self, kv_cache: list) -> list:
        return [
            cache if worker is None else worker.warm_up(cache)
            for worker, cache in zip(self.workers, kv_cache, strict=True)
        ]

    def keep_blocks(self, kv_cache: list, metadata: KVConnectorMetadata) -> None:
        for worker, cache in zip(self.workers, kv_cache, strict=True):
            if worker is not None:
                worker.keep_blocks(cache, metadata)

    def close(self) -> None:
        for worker in self.workers:
            if worker is not None:
                worker.close()
