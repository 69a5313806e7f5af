"""Publishes the engine core's KV cache events over ZMQ, as vLLM's ZmqEventPublisher does on the wire.

Each step's events (core/kv_events.py) go, as one batch, into a bounded queue; a thread encodes each
batch with msgspec and sends it on a PUB socket as three frames: the topic, an 8-byte big-endian
sequence number (0, 1, ... per publisher) and the msgpack payload. The step only enqueues: encoding
and sending stay off it (a full queue blocks the step rather than drop events a router's view needs).

A subscriber that sees a gap in the sequence asks the ROUTER socket at `replay_endpoint` (when set)
for the batches from a sequence number on, with one frame of 8 bytes (big-endian); it gets each kept
batch as (topic, sequence, payload), as the PUB socket sent it, then (b"", -1, b"") after the last
(vLLM main's replay reply, which added the topic: vllm#45174). The last `buffer_steps` batches are kept.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from xlaserve.config.kv_events import KVEventsConfig
from xlaserve.core.kv_events import KVCacheEvent, KVEventBatch

logger = logging.getLogger(__name__)

_END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.1  # how long the thread waits for a batch before it looks at the replay socket again
_SHUTDOWN_S = 2.0  # how long shutdown waits for queued batches to be sent
_IDLE = object()  # no batch came within _POLL_S


class ZmqEventPublisher:
    """One data-parallel rank's publisher (`config` already carries the rank's endpoint)."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0):
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._pub = self._replay = None
        # The thread opens, uses and closes both sockets (a ZMQ socket belongs to one thread); an address
        # it cannot bind is raised here.
        self._started = threading.Event()
        self._start_error: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise ValueError(f"kv_events_config: cannot open {config.endpoint}: {self._start_error}")
        logger.info("publishing KV cache events on %s", config.endpoint)

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one step's events as a batch (a full queue waits for the thread)."""
        self._queue.put(
            KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.data_parallel_rank)
        )

    def shutdown(self) -> None:
        """Send what is queued (for up to a couple of seconds), then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout=_SHUTDOWN_S)
        if self._thread.is_alive():
            logger.warning("KV cache events: %d batches were not sent before shutdown", self._queue.qsize())

    def _open(self) -> None:
        context = zmq.Context.instance()
        self._pub = context.socket(zmq.PUB)
        self._pub.set_hwm(self.config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if _binds(self.config.endpoint):  # vLLM's rule: a stable publisher binds, a volatile one connects
            self._pub.bind(self.config.endpoint)
        else:
            self._pub.connect(self.config.endpoint)
        if self.config.replay_endpoint is not None:
            self._replay = context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(self.config.replay_endpoint)

    def _run(self) -> None:
        try:
            self._open()
        except zmq.ZMQError as e:
            self._start_error = e
            self._close()
            return
        finally:
            self._started.set()
        encoder = msgspec.msgpack.Encoder()
        topic = self.config.topic.encode()
        seq = 0
        while True:
            try:
                batch = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                batch = _IDLE
            if batch is None:
                self._close()
                return
            if batch is not _IDLE:
                payload = encoder.encode(batch)
                self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                self._kept.append((seq, payload))
                seq += 1
            # A replay waits for the queue to drain: it then holds every batch published before it was asked.
            if self._replay is not None and self._queue.empty() and self._replay.poll(0):
                self._serve_replay()

    def _close(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close()

    def _serve_replay(self) -> None:
        topic = self.config.topic.encode()
        frames = self._replay.recv_multipart()
        if len(frames) != 3:  # a REQ client's [identity, empty delimiter, start sequence]
            logger.warning("KV cache events: a replay request of %d frames, not 3, ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._kept):
            if seq >= first:
                self._replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", _END_OF_REPLAY, b""))


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
