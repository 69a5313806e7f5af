"""vLLM's KV cache event structs, declared here as vLLM declares them (vllm/distributed/kv_events.py at
main: the wire vLLM 0.26 sends, and what main added since: `locality`, `ownership`, typed `extra_keys`
with `event_version`), not imported from xlaserve, so a test that decodes the engine's events with them
proves the format a router (llm-d's, Dynamo's) reads; and a subscriber."""

from __future__ import annotations

import socket
from typing import Any

import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class ExtraKey(msgspec.Struct, gc=False, frozen=True, tag=True):
    pass


class LoRAKey(ExtraKey, frozen=True, tag="lora"):
    name: str


class CacheSaltKey(ExtraKey, frozen=True, tag="cache_salt"):
    salt: str


class PromptEmbedsKey(ExtraKey, frozen=True, tag="prompt_embeds"):
    hash: bytes


class MultiModalKey(ExtraKey, frozen=True, tag="mm"):
    modality: str
    hash: str
    block_offset: int


class LegacyExtraKey(ExtraKey, frozen=True, tag="legacy"):
    value: Any


ExtraKeyUnion = ExtraKey | LoRAKey | CacheSaltKey | PromptEmbedsKey | MultiModalKey | LegacyExtraKey


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    event_version: int = 1
    extra_keys: list[tuple[ExtraKeyUnion, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def subscribe(topic: str = "kv") -> tuple[zmq.Socket, str]:
    """A SUB socket and the endpoint to give an engine (kv_events_config's): connected before the
    engine binds (ZMQ connects once it does), so it misses no batch."""
    port = free_port()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(f"tcp://127.0.0.1:{port}")
    return sub, f"tcp://*:{port}"


def subscribe_late(endpoint: str, topic: str = "kv") -> zmq.Socket:
    """A SUB socket connected to an engine already publishing on `endpoint` (its kv_events_config's):
    it sees only the batches sent after it joined, the start-up batch (sequence 0) not among them."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint.replace("*", "127.0.0.1"))
    return sub


def receive(sub: zmq.Socket, timeout_ms: int = 5000, topic: bytes = b"kv") -> dict[int, bytes]:
    """The batches that arrive (sequence number -> payload) until the socket is quiet for 0.5 s."""
    batches = {}
    while sub.poll(timeout_ms):
        frame_topic, seq, payload = sub.recv_multipart()
        assert frame_topic == topic
        batches[int.from_bytes(seq, "big")] = payload
        timeout_ms = 500
    return batches


def replay(endpoint: str, start: int, topic: bytes = b"kv") -> dict[int, bytes]:
    """What a subscriber that missed batches asks for (vLLM's replay protocol): every kept batch from
    `start`, each as (topic, sequence, payload), then (b"", -1, b""). A DEALER: a REQ socket takes one
    reply only."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart((b"", start.to_bytes(8, "big")))
    batches = {}
    while True:
        assert dealer.poll(10_000), "no replay answer"
        empty, frame_topic, seq, payload = dealer.recv_multipart()
        assert empty == b""
        if int.from_bytes(seq, "big", signed=True) == -1:
            assert (frame_topic, payload) == (b"", b"")
            dealer.close()
            return batches
        assert frame_topic == topic  # the PUB socket's frames, topic first
        batches[int.from_bytes(seq, "big")] = payload
