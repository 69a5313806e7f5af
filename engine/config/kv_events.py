"""vLLM's `kv_events_config`: publish the prefix cache's changes for KV-cache-aware routers.

With `enable_kv_cache_events` and the "zmq" publisher, the engine core publishes, after each step, the
blocks the prefix cache stored and removed (core/kv_events.py) on a ZMQ PUB socket at `endpoint`
(engine/engine/kv_events.py); a ROUTER socket at `replay_endpoint` resends the last `buffer_steps`
batches to a subscriber that missed some. The "null" publisher, or events off, records nothing.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace

from xlaserve.config.checks import require
from xlaserve.config_args import json_object

KV_EVENT_PUBLISHERS = ("null", "zmq")
_KEYS = (
    "enable_kv_cache_events",
    "publisher",
    "endpoint",
    "replay_endpoint",
    "buffer_steps",
    "hwm",
    "max_queue_size",
    "topic",
)


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    # None: "zmq" when events are on, else "null" (vLLM's default).
    publisher: str | None = None
    # `*` (any interface), `::`, ipc:// and inproc:// bind; a host connects (to a subscriber that binds).
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark (messages)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; a full queue blocks the step
    topic: str = ""

    def __post_init__(self):
        require(
            isinstance(self.enable_kv_cache_events, bool),
            "kv_events_config.enable_kv_cache_events must be true or false, got "
            f"{self.enable_kv_cache_events!r}",
        )
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        require(
            self.publisher in KV_EVENT_PUBLISHERS,
            f"kv_events_config.publisher must be one of {KV_EVENT_PUBLISHERS}, got {self.publisher!r}",
        )
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if name == "replay_endpoint" and value is None:
                continue
            require(
                isinstance(value, str) and value.startswith(("tcp://", "ipc://", "inproc://")),
                f"kv_events_config.{name} must be a ZMQ address (tcp://, ipc:// or inproc://), got {value!r}",
            )
            port = tcp_port(value)
            require(
                not value.startswith("tcp://") or (port is not None and 1 <= port <= 65535),
                f"kv_events_config.{name} must end in a port in [1, 65535] (tcp://HOST:PORT), got {value!r}",
            )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            require(
                isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 10_000_000,
                f"kv_events_config.{name} must be in [1, 10000000], got {value!r}",
            )
        require(isinstance(self.topic, str), f"kv_events_config.topic must be a string, got {self.topic!r}")

    @property
    def is_publishing(self) -> bool:
        """Events are recorded and sent: on, through a real publisher."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def for_rank(self, data_parallel_rank: int) -> KVEventsConfig:
        """This data-parallel rank's config: tcp ports offset by the rank (vLLM's), so each rank
        publishes on its own socket; ipc and inproc addresses get a `_dp<rank>` suffix."""
        if data_parallel_rank == 0:
            return self
        return replace(
            self,
            endpoint=offset_endpoint(self.endpoint, data_parallel_rank),
            replay_endpoint=offset_endpoint(self.replay_endpoint, data_parallel_rank),
        )

    @classmethod
    def parse(cls, value) -> KVEventsConfig | None:
        """A dict, its JSON text (the CLI's --kv-events-config), a KVEventsConfig, or None."""
        if value is None or isinstance(value, KVEventsConfig):
            return value
        value = json_object(value, "kv_events_config")
        unknown = sorted(set(value) - set(_KEYS))
        require(not unknown, f"kv_events_config: unknown field(s) {unknown}; known: {list(_KEYS)}")
        return cls(**value)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def offset_endpoint(endpoint: str | None, offset: int) -> str | None:
    """`endpoint` with its tcp port raised by `offset` (another address: `_dp<offset>` appended)."""
    if endpoint is None or offset == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + offset}"
    return f"{endpoint}_dp{offset}"


def tcp_port(endpoint: str | None) -> int | None:
    """The port of a tcp:// address (None for another kind, or no port)."""
    if endpoint is None or not endpoint.startswith("tcp://"):
        return None
    port = endpoint.rpartition(":")[2]
    return int(port) if port.isdigit() else None
