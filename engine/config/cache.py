"""The KV cache: block size, memory budget, prefix caching, host offload and cache dtype."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from xlaserve.config.checks import require
from xlaserve.config.kv_events import KVEventsConfig
from xlaserve.config.kv_transfer import KVTransferConfig
from xlaserve.config_args import arg

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = field(default=16, metadata=arg("tokens per KV cache block (8, 16, 32, 64 or 128)"))
    enable_prefix_caching: bool = field(
        default=True, metadata=arg("reuse the KV blocks of a shared prompt prefix (default: on)")
    )
    gpu_memory_utilization: float = field(
        default=0.9, metadata=arg("the share of device memory the engine may use, weights included (GPU)")
    )
    # Bytes for the KV cache, on any platform. Unset: 512 MiB on CPU (`_DEFAULT_CPU_KV_CACHE_MEMORY`
    # in worker/model_runner.py); on GPU, gpu_memory_utilization of the device's memory, less what is in use.
    kv_cache_memory: int | None = field(default=None, metadata=arg("KV cache budget in bytes (CPU)"))
    num_gpu_blocks_override: int | None = field(
        default=None, metadata=arg("KV cache blocks, whatever the memory budget (tests, benchmarks)")
    )
    # auto: the model's dtype; fp8 (= fp8_e4m3) or fp8_e5m2: one byte per value, twice the blocks.
    kv_cache_dtype: str = field(
        default="auto",
        metadata=arg(
            "KV cache storage; fp8: one byte per value, twice the blocks (default: auto, the model's dtype)",
            choices=KV_CACHE_DTYPES,
        ),
    )
    # GiB of host memory for blocks the device prefix cache evicts, loaded back on a later prefix hit
    # (core/kv_offload.py, worker/kv_offload.py; README "KV cache offload"). None: off.
    kv_offloading_size: float | None = field(
        default=None,
        metadata=arg(
            "GiB of host memory holding KV blocks evicted from the device cache, reloaded on a prefix "
            "hit (default: off)"
        ),
    )
    # A disk tier below the host tier: blocks the host tier evicts go to files in this directory, and a
    # prefix hit there loads them straight to the device. None: off. Its size in GiB (None: four times
    # the host tier's).
    kv_offloading_disk_path: str | None = field(
        default=None,
        metadata=arg(
            "a directory for a disk tier of KV blocks evicted from the host tier (needs "
            "--kv-offloading-size; default: none)"
        ),
    )
    kv_offloading_disk_size: float | None = field(
        default=None,
        metadata=arg("GiB of the disk tier (default: 4x --kv-offloading-size)"),
    )
    # Keep the disk tier for the next engine: at a clean shutdown the cached blocks (device's, host's)
    # go to it and its index is written beside its files; an engine of the same model and cache
    # layout started on the same path begins with them (core/kv_offload.py `persistent_tier_dir`).
    kv_offloading_disk_persist: bool = field(
        default=False,
        metadata=arg(
            "keep the disk tier when the engine shuts down (every cached block written to it), for the "
            "next engine of the same model and cache layout on the same path (default: off)"
        ),
    )

    @property
    def disk_tier_size(self) -> float | None:
        """GiB of the disk tier (None: no disk tier)."""
        if self.kv_offloading_disk_path is None:
            return None
        return self.kv_offloading_disk_size or 4 * self.kv_offloading_size

    # Disaggregated prefill (vLLM's --kv-transfer-config): the connector, this engine's role and the
    # producer's address, as JSON (config/kv_transfer.py). Kept as JSON text: the config stays hashable.
    kv_transfer_config: str | None = field(
        default=None,
        metadata=arg(
            'disaggregated prefill, as JSON: {"kv_connector": "JaxConnector", "kv_role": '
            '"kv_producer"|"kv_consumer"|"kv_both", "kv_ip": "127.0.0.1", "kv_port": 14579} '
            '(README "Disaggregated prefill"; default: off)'
        ),
    )

    @property
    def kv_transfer(self) -> KVTransferConfig | None:
        """kv_transfer_config parsed (None: off)."""
        return None if self.kv_transfer_config is None else KVTransferConfig.parse(self.kv_transfer_config)

    # KV cache events for prefix-aware routers (vLLM's --kv-events-config), as JSON (config/kv_events.py).
    kv_events_config: str | None = field(
        default=None,
        metadata=arg(
            "publish the prefix cache's stored and removed blocks over ZMQ, as JSON: "
            '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "topic": ""} '
            '(README "KV cache events"; default: off)'
        ),
    )

    @property
    def kv_events(self) -> KVEventsConfig | None:
        """kv_events_config parsed (None: never given)."""
        return None if self.kv_events_config is None else KVEventsConfig.parse(self.kv_events_config)

    def __post_init__(self):
        if self.kv_events_config is not None:
            parsed = KVEventsConfig.parse(self.kv_events_config)  # a bad value is an error at start
            object.__setattr__(self, "kv_events_config", parsed.to_json())
        if self.kv_transfer_config is not None:
            parsed = KVTransferConfig.parse(self.kv_transfer_config)  # a bad value is an error at start
            object.__setattr__(self, "kv_transfer_config", parsed.to_json())
        for name in ("kv_offloading_size", "kv_offloading_disk_size"):
            value = getattr(self, name)
            require(value is None or _is_gib(value), f"{name} must be a number of GiB > 0, got {value!r}")
        require(
            self.kv_offloading_size is None or self.enable_prefix_caching,
            "kv_offloading_size needs enable_prefix_caching: the host tier holds the blocks the prefix "
            "cache evicts, under their hashes",
        )
        for name in ("kv_offloading_disk_path", "kv_offloading_disk_size"):
            require(
                getattr(self, name) is None or self.kv_offloading_size is not None,
                f"{name} needs kv_offloading_size: the disk tier holds what the host tier evicts",
            )
        require(
            self.kv_offloading_disk_size is None or self.kv_offloading_disk_path is not None,
            "kv_offloading_disk_size needs kv_offloading_disk_path (the directory of the disk tier)",
        )
        require(
            not self.kv_offloading_disk_persist or self.kv_offloading_disk_path is not None,
            "kv_offloading_disk_persist needs kv_offloading_disk_path (the directory of the disk tier)",
        )
        require(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}",
        )
        require(
            self.block_size in (8, 16, 32, 64, 128),
            f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}",
        )
        require(
            0.0 < self.gpu_memory_utilization <= 1.0,
            f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        require(
            self.kv_cache_memory is None or self.kv_cache_memory > 0,
            f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}",
        )
        require(
            self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 2,
            f"num_gpu_blocks_override must be >= 2, got {self.num_gpu_blocks_override}",
        )


def _is_gib(value) -> bool:
    """A size in GiB: a finite number > 0 (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf
