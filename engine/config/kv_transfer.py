"""vLLM's `kv_transfer_config`: disaggregated prefill's connector, role and address.

A producer (`kv_producer`) runs the prefill of a request asked for it (`kv_transfer_params`:
{"do_remote_decode": true}) and serves the prompt's K/V blocks from `kv_ip:kv_port`; a consumer
(`kv_consumer`) fetches them for a request naming that producer (`do_remote_prefill`) and decodes.
`kv_both` does either. The connector itself: core/kv_transfer.py (the scheduler's half),
worker/kv_transfer.py (the worker's), engine/engine/kv_fetch.py (the consumer's fetches).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from xlaserve.config.checks import require
from xlaserve.config_args import json_object

KV_CONNECTORS = ("JaxConnector",)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
_KEYS = ("kv_connector", "kv_role", "kv_ip", "kv_port", "kv_connector_extra_config")
_EXTRA_KEYS = ("timeout_s", "send_ttl_s", "chunk_blocks")


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str = "JaxConnector"
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"  # where a producer's block server listens (and what it tells consumers)
    kv_port: int = 14579
    # timeout_s: a consumer waits this long for each chunk before it computes the prefill itself;
    # send_ttl_s: a producer keeps blocks nobody fetched this long; chunk_blocks: blocks per message.
    kv_connector_extra_config: dict | None = None

    def __post_init__(self):
        require(
            self.kv_connector in KV_CONNECTORS,
            f"kv_transfer_config.kv_connector must be one of {KV_CONNECTORS}, got {self.kv_connector!r}",
        )
        require(
            self.kv_role in KV_ROLES,
            f"kv_transfer_config.kv_role must be one of {KV_ROLES}, got {self.kv_role!r}",
        )
        require(
            isinstance(self.kv_ip, str) and self.kv_ip,
            f"kv_transfer_config.kv_ip must be a host, got {self.kv_ip!r}",
        )
        require(
            isinstance(self.kv_port, int)
            and not isinstance(self.kv_port, bool)
            and 1 <= self.kv_port <= 65535,
            f"kv_transfer_config.kv_port must be in [1, 65535], got {self.kv_port!r}",
        )
        extra = self.kv_connector_extra_config or {}
        require(isinstance(extra, dict), "kv_transfer_config.kv_connector_extra_config must be a JSON object")
        unknown = sorted(set(extra) - set(_EXTRA_KEYS))
        require(
            not unknown,
            f"kv_transfer_config.kv_connector_extra_config: unknown field(s) {unknown}; "
            f"known: {list(_EXTRA_KEYS)}",
        )
        for name in ("timeout_s", "send_ttl_s"):
            value = extra.get(name, 1.0)
            require(
                isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 3600,
                f"kv_transfer_config.kv_connector_extra_config.{name} must be in (0, 3600] seconds, "
                f"got {value!r}",
            )
        chunk = extra.get("chunk_blocks", 1)
        require(
            isinstance(chunk, int) and not isinstance(chunk, bool) and 1 <= chunk <= 4096,
            f"kv_transfer_config.kv_connector_extra_config.chunk_blocks must be in [1, 4096], got {chunk!r}",
        )

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def _extra(self, name: str, default):
        return (self.kv_connector_extra_config or {}).get(name, default)

    @property
    def timeout_s(self) -> float:
        return float(self._extra("timeout_s", 30.0))

    @property
    def send_ttl_s(self) -> float:
        return float(self._extra("send_ttl_s", 120.0))

    @property
    def chunk_blocks(self) -> int:
        return int(self._extra("chunk_blocks", 64))

    @classmethod
    def parse(cls, value) -> KVTransferConfig | None:
        """A dict, its JSON text (the CLI's --kv-transfer-config), a KVTransferConfig, or None."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        value = json_object(value, "kv_transfer_config")
        unknown = sorted(set(value) - set(_KEYS))
        require(not unknown, f"kv_transfer_config: unknown field(s) {unknown}; known: {list(_KEYS)}")
        require("kv_role" in value, f"kv_transfer_config.kv_role is required (one of {KV_ROLES})")
        return cls(**value)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)
