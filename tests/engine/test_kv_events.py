"""KV cache events (--kv-events-config): the publisher's replay protocol and the config's checks. The
engine's events, decoded by a subscriber with vLLM's structs: tests/entrypoints/test_weight_update.py
(riding its engine); the events the prefix cache records: tests/core/test_kv_cache_manager.py."""

from __future__ import annotations

import dataclasses

import pytest

from helpers.vllm_kv_events import DECODER, AllBlocksCleared, free_port, replay
from xlaserve.config import EngineConfig
from xlaserve.config.kv_events import KVEventsConfig
from xlaserve.core import kv_events
from xlaserve.engine.kv_events import ZmqEventPublisher


def test_a_subscriber_that_missed_batches_gets_them_replayed():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://*:{free_port()}",
        replay_endpoint=endpoint,
        buffer_steps=3,
        topic="kv",
    )
    publisher = ZmqEventPublisher(config, data_parallel_rank=1)
    try:
        for _ in range(4):
            publisher.publish([kv_events.AllBlocksCleared()])
        kept = replay(endpoint, 2)
        assert list(kept) == [2, 3]
        batches = [DECODER.decode(payload) for payload in kept.values()]
        assert all(b.data_parallel_rank == 1 and b.events == [AllBlocksCleared()] for b in batches)
        # vLLM's answers to a start out of the buffer: one older than the oldest kept gets all it keeps
        # (batch 0 is gone), one past the newest only the end marker.
        assert list(replay(endpoint, 0)) == [1, 2, 3]
        assert replay(endpoint, 9) == {}
    finally:
        publisher.shutdown()


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
