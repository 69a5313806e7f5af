"""A consumer's fetches of prompt blocks from a producer (disaggregated prefill: core/kv_transfer.py).

A request that names a producer (`kv_transfer_params.do_remote_prefill`) waits here, not in the
scheduler, while a thread asks the producer's block server for its blocks chunk by chunk: each chunk
is asked for once the previous one arrived (the consumer sets the pace), and each must arrive within
`timeout_s`. Then the engine core hands the request to the scheduler, with the blocks attached
(`Request.remote_kv`) or, when the fetch failed, without them: it computes its prompt itself.

Blocks the consumer already holds are not fetched: the engine core says, when it submits a request, how
many of its prompt's leading tokens its device prefix cache and host tier hold (a conversation coming
back), and the fetch starts at the first block past them. When they hold every block the producer
would send, the producer is only told to drop its copy (`kv_transfer_fetches{outcome="cached"}`).

The n children of an n > 1 request share one prompt, so one fetch: the first child's. Its siblings
wait with it and join the scheduler right after it, without blocks of their own; the first child's
blocks are indexed in the prefix cache once it is scheduled (in the same step, too), so they hit them
there, as the children of any n > 1 request share their prompt's blocks. A producer serves a prompt's
blocks once, so a second fetch would fail and compute the prompt again.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import zmq

from xlaserve.config import KVTransferConfig
from xlaserve.core.kv_connector import KVTransferStats
from xlaserve.core.kv_transfer import GET, RemoteKV, decode_header, is_remote_prefill, prefix_digest
from xlaserve.core.request import Request

logger = logging.getLogger(__name__)

_MAX_CONCURRENT_FETCHES = 4


class FetchError(Exception):
    pass


@dataclass
class _Siblings:
    """The children of one n > 1 request while some are still to come or to be handed over."""

    num_to_come: int  # children not submitted yet
    is_fetched: bool = False  # the first child's fetch is over (handed over)
    waiting: list[Request] = field(default_factory=list)  # children waiting on that fetch


class RemotePrefills:
    """Requests whose prompt blocks are being fetched; the base case (no consumer role) holds none."""

    def __init__(self, config: KVTransferConfig | None, block_size: int, bytes_per_block: int):
        self.config = config
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self._pool: ThreadPoolExecutor | None = None
        self._pending: set[str] = set()
        self._ready: list[Request] = []
        self._aborted: set[str] = set()
        self._siblings: dict[str, _Siblings] = {}  # by parent request id
        self._lock = threading.Lock()
        self._arrived = threading.Event()
        self.stats = KVTransferStats()

    def wants(self, request: Request) -> bool:
        """The request is to be fetched for (this engine consumes, and it names a producer)."""
        return self.config is not None and self.config.is_consumer and is_remote_prefill(request)

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending) + len(self._ready)

    def submit(self, request: Request, num_local_tokens: int = 0) -> None:
        """Fetch the request's prompt blocks past its first `num_local_tokens` (held here already)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(_MAX_CONCURRENT_FETCHES, thread_name_prefix="xlaserve-kv-fetch")
        with self._lock:
            if self._follows_sibling(request):
                return
            self._pending.add(request.request_id)
        self._pool.submit(self._fetch_and_hand_over, request, num_local_tokens)

    def _follows_sibling(self, request: Request) -> bool:
        """An n > 1 request's child after its first: it waits for the first child's fetch (or, that
        over, is handed over at once). The first child starts the group. Under the lock."""
        parent = request.parent_id
        if parent is None:
            return False
        group = self._siblings.get(parent)
        if group is None:
            self._siblings[parent] = _Siblings(num_to_come=request.sampling_params.n - 1)
            return False
        group.num_to_come -= 1
        if group.is_fetched:
            self._ready.append(request)
            self._arrived.set()
        else:
            group.waiting.append(request)
            self._pending.add(request.request_id)
        self._drop_if_done(parent, group)
        return True

    def _drop_if_done(self, parent: str, group: _Siblings) -> None:
        if group.is_fetched and group.num_to_come <= 0:
            del self._siblings[parent]

    def take_ready(self) -> list[Request]:
        """Requests whose fetch is over (blocks attached, or failed), aborted ones left out."""
        with self._lock:
            ready, self._ready = self._ready, []
            self._arrived.clear()
            kept = [r for r in ready if r.request_id not in self._aborted]
            self._aborted -= {r.request_id for r in ready}
        return kept

    def wait(self, timeout_s: float) -> None:
        """Block until a fetch is over, `timeout_s` at most."""
        self._arrived.wait(timeout_s)

    def request_ids(self) -> list[str]:
        """The requests still here (fetching, or fetched and not yet taken), aborted ones left out."""
        with self._lock:
            return sorted((self._pending | {r.request_id for r in self._ready}) - self._aborted)

    def abort(self, request_ids) -> None:
        with self._lock:
            self._aborted |= set(request_ids) & (self._pending | {r.request_id for r in self._ready})

    def make_stats(self) -> KVTransferStats:
        with self._lock:
            stats, self.stats = self.stats, KVTransferStats()
        return stats

    def _fetch_and_hand_over(self, request: Request, num_local_tokens: int) -> None:
        t0 = time.perf_counter()
        try:
            remote = self.fetch(request, num_local_tokens)
            failed = False
        except Exception as e:  # the producer is gone, slow or holds something else: compute locally
            logger.warning(
                "request %s: fetching its prompt's KV blocks failed (%s); computing the prompt here",
                request.request_id,
                e,
            )
            remote, failed = None, True
        request.remote_kv = remote
        with self._lock:
            s = self.stats
            s.num_remote_fetches += 1
            s.num_remote_fetch_failures += failed
            if remote is not None:
                num_blocks = (remote.num_tokens - remote.first_token) // self.block_size
                if remote.first_token and not num_blocks:  # its own caches held the prompt
                    s.num_remote_fetches_cached += 1
                s.num_blocks_fetched += num_blocks
                s.bytes_fetched += num_blocks * self.bytes_per_block
            s.fetch_seconds += time.perf_counter() - t0
            self._pending.discard(request.request_id)
            self._ready.append(request)
            group = self._siblings.get(request.parent_id) if request.parent_id is not None else None
            if group is not None:  # its siblings follow it into the scheduler
                self._pending -= {r.request_id for r in group.waiting}
                self._ready += group.waiting
                group.waiting, group.is_fetched = [], True
                self._drop_if_done(request.parent_id, group)
            self._arrived.set()

    def fetch(self, request: Request, num_local_tokens: int = 0) -> RemoteKV:
        """The request's prompt blocks past its first `num_local_tokens` from the producer its
        kv_transfer_params name (FetchError, or a socket's error, when they cannot be had)."""
        params = request.sampling_params.kv_transfer_params
        num_blocks = (request.num_prompt_tokens - 1) // self.block_size
        first_block = min(num_local_tokens // self.block_size, num_blocks)
        digest = prefix_digest(request, num_blocks * self.block_size)
        timeout_ms = int(self.config.timeout_s * 1000)
        socket = zmq.Context.instance().socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.connect(f"tcp://{params['remote_host']}:{params['remote_port']}")
            chunks: list[list[np.ndarray]] = []
            chunk, num_chunks = 0, 1
            # first_block goes only where it is not 0: a producer before it takes four frames.
            skip = [str(first_block).encode()] if first_block else []
            request_id = params["remote_request_id"].encode()
            while chunk < num_chunks:
                socket.send_multipart([GET, request_id, digest.encode(), str(chunk).encode(), *skip])
                if not socket.poll(timeout_ms):
                    raise FetchError(f"chunk {chunk} not answered within {self.config.timeout_s} s")
                header, *frames = socket.recv_multipart()
                header = decode_header(header)
                if header.get("status") != "ok":
                    raise FetchError(f"the producer answered {header.get('status')!r}: {header.get('error')}")
                self._check(header, num_blocks)
                chunks.append(
                    [np.frombuffer(f, np.uint8).reshape(-1, n) for f, n in zip(frames, header["block_bytes"])]
                )
                chunk, num_chunks = chunk + 1, header["num_chunks"]
        finally:
            socket.close()
        blocks = tuple(np.concatenate(parts) for parts in zip(*chunks))
        if blocks and len(blocks[0]) != num_blocks - first_block:
            raise FetchError(f"{len(blocks[0])} blocks arrived, {num_blocks - first_block} expected")
        return RemoteKV(num_blocks * self.block_size, blocks, first_block * self.block_size)

    def _check(self, header: dict, num_blocks: int) -> None:
        if header["block_size"] != self.block_size:
            raise FetchError(
                f"the producer's block_size is {header['block_size']}, this engine's {self.block_size}"
            )
        if sum(header["block_bytes"]) != self.bytes_per_block or header["num_blocks"] != num_blocks:
            raise FetchError(
                f"the producer holds {header['num_blocks']} blocks of {sum(header['block_bytes'])} bytes; "
                f"this engine needs {num_blocks} of {self.bytes_per_block} (another model, cache dtype or "
                "draft model?)"
            )

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
