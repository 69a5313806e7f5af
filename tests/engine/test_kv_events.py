"""KV cache events (--kv-events-config) read by a subscriber as an llm-d or Dynamo router reads vLLM's:
a real ZMQ SUB socket, and msgspec structs declared here as vLLM declares them (vllm/distributed/
kv_events.py at main, vLLM 0.26's wire), not imported from xlaserve, so the test proves the format."""

from __future__ import annotations

import dataclasses
import socket
from typing import Any

import msgspec
import pytest
import zmq

from xlaserve import LLM, SamplingParams
from xlaserve.config import EngineConfig
from xlaserve.config.kv_events import KVEventsConfig
from xlaserve.core import kv_events
from xlaserve.engine.kv_events import ZmqEventPublisher


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


BLOCK = 8
ENGINE_ARGS = {
    "dtype": "float32",
    "max_model_len": 64,
    "max_num_seqs": 2,
    "block_size": BLOCK,
    "num_gpu_blocks_override": 16,
    "enforce_eager": True,
}


def _receive(sub, timeout_ms: int = 5000) -> dict[int, bytes]:
    """The batches that arrive (sequence number -> payload) until the socket is quiet for 0.5 s."""
    batches = {}
    while sub.poll(timeout_ms):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv"
        batches[int.from_bytes(seq, "big")] = payload
        timeout_ms = 500
    return batches


def _replay(endpoint: str, start: int) -> dict[int, bytes]:
    """What a subscriber that missed batches asks for (vLLM's replay protocol): every kept batch from
    `start`, each as (sequence, payload), then (-1, b""). A DEALER: a REQ socket takes one reply only."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart((b"", start.to_bytes(8, "big")))
    batches = {}
    while True:
        assert dealer.poll(10_000), "no replay answer"
        empty, seq, payload = dealer.recv_multipart()
        assert empty == b""
        if int.from_bytes(seq, "big", signed=True) == -1:
            assert payload == b""
            dealer.close()
            return batches
        batches[int.from_bytes(seq, "big")] = payload


def test_a_subscriber_rebuilds_the_prefix_cache_from_the_events(llama_checkpoints):
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.setsockopt(zmq.LINGER, 0)
    port = _free_port()
    sub.connect(f"tcp://127.0.0.1:{port}")  # before the engine binds: ZMQ connects once it does
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}", "topic": "kv"}
    llm = LLM(llama_checkpoints[0], kv_events_config=config, **ENGINE_ARGS)
    try:
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        shared = list(range(3, 19))  # two full blocks both prompts share
        prompts = [shared + list(range(40, 46)), shared + list(range(60, 69))]
        params = SamplingParams(max_tokens=3, temperature=0.0)
        for prompt in prompts:
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        # Connected since the engine bound (before its warm-up), the subscriber misses nothing.
        live = _receive(sub)
        assert list(live) == list(range(len(live)))
        batches = [decoder.decode(live[seq]) for seq in sorted(live)]
        assert all(batch.data_parallel_rank == 0 for batch in batches)
        events = [event for batch in batches for event in batch.events]
        assert all(isinstance(event, BlockStored) for event in events)  # nothing was evicted

        # A router's view: each stored block under its hash, chained to a block it saw before.
        held: dict[int, list[int]] = {}
        for event in events:
            assert event.parent_block_hash is None or event.parent_block_hash in held
            assert (event.block_size, event.medium, event.group_idx) == (BLOCK, "GPU", 0)
            for i, block_hash in enumerate(event.block_hashes):
                assert block_hash not in held  # each block is stored once
                held[block_hash] = event.token_ids[i * BLOCK : (i + 1) * BLOCK]
        cached = llm.engine_core.kv_cache_manager.cached_blocks()
        assert sorted(held) == sorted(int.from_bytes(h[-8:], "big") for h, _ in cached)
        # The first prompt's K/V fills 3 blocks (22 prompt tokens and 2 of its 3 outputs: the last one's
        # is never computed); the second (25 tokens) hits the shared two and stores its third, chained
        # to the shared second.
        assert len(held) == 4
        assert events[0].token_ids == shared and events[0].parent_block_hash is None
        assert events[-1].token_ids[:8] == list(range(60, 68))
        assert events[-1].parent_block_hash == events[0].block_hashes[1]

        assert llm.reset_prefix_cache()
        [(seq, payload)] = _receive(sub).items()
        assert seq == len(live) and decoder.decode(payload).events == [AllBlocksCleared()]
    finally:
        llm.shutdown()
        sub.close()


def test_a_subscriber_that_missed_batches_gets_them_replayed():
    """vLLM's replay protocol, on the publisher alone: the batches kept from a sequence number on."""
    replay = f"tcp://127.0.0.1:{_free_port()}"
    config = KVEventsConfig(
        enable_kv_cache_events=True, endpoint=f"tcp://*:{_free_port()}", replay_endpoint=replay
    )
    publisher = ZmqEventPublisher(config, data_parallel_rank=1)
    try:
        for _ in range(3):
            publisher.publish([kv_events.AllBlocksCleared()])
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        kept = _replay(replay, 1)
        assert list(kept) == [1, 2]
        assert all(decoder.decode(p).data_parallel_rank == 1 for p in kept.values())
    finally:
        publisher.shutdown()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_kv_events_config_is_checked():
    with pytest.raises(ValueError, match=r"kv_events_config: unknown field\(s\) \['port'\]"):
        EngineConfig.from_kwargs(kv_events_config={"enable_kv_cache_events": True, "port": 1})
    with pytest.raises(ValueError, match="kv_events_config.publisher must be one of"):
        EngineConfig.from_kwargs(kv_events_config='{"enable_kv_cache_events": true, "publisher": "kafka"}')
    with pytest.raises(ValueError, match=r"kv_events_config.endpoint must end in a port in \[1, 65535\]"):
        EngineConfig.from_kwargs(kv_events_config={"enable_kv_cache_events": True, "endpoint": "tcp://*"})
    with pytest.raises(ValueError, match="data_parallel_size=2 ranks publish on 2 consecutive ports"):
        EngineConfig.from_kwargs(
            kv_events_config={"enable_kv_cache_events": True, "endpoint": "tcp://*:65535"},
            data_parallel_size=2,
        )
    config = EngineConfig.from_kwargs(
        kv_events_config={"enable_kv_cache_events": True, "endpoint": "tcp://*:5557"}, data_parallel_size=2
    )
    rank1 = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, data_parallel_rank=1))
    assert (config.kv_events.endpoint, rank1.kv_events.endpoint) == ("tcp://*:5557", "tcp://*:5558")
    assert EngineConfig.from_kwargs(kv_events_config={"publisher": "zmq"}).kv_events is None  # events off
