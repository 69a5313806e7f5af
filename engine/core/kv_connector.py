"""The KV connector: how K/V held outside the device cache reaches a step, in vLLM's KVConnectorBase_V1 shape.

Two halves, as in vLLM. The scheduler's half (`KVConnectorScheduler`) answers, for a request being
admitted, how many prompt tokens past the device prefix hit an outside source holds
(`get_num_new_matched_tokens`); the scheduler then allocates device blocks for them as if they were
computed, tells the connector which blocks they are (`update_state_after_alloc`), and at the end of
`schedule()` asks for the step's transfer plan (`build_connector_meta`). The worker's half
(`KVConnectorWorker`) carries that plan out around the step: `save_kv` copies blocks out of the device
cache, `load_kv` copies blocks into it, both before the forward can overwrite or read them.

With no connector configured both halves are these base classes, whose methods do nothing: the
scheduler and the runner call them at the same fixed points whatever is on (no feature branch). Host
offload (core/kv_offload.py, worker/kv_offload.py) is one connector; disaggregated prefill
(core/kv_transfer.py, worker/kv_transfer.py) another.
Plain data and plain Python: no jax here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from xlaserve.core.kv_events import KVCacheEvent
from xlaserve.core.request import Request


def _no_ids() -> np.ndarray:
    return np.zeros(0, np.int32)


@dataclass
class KVConnectorMetadata:
    """One step's transfers, decided by the scheduler's half and carried out by the worker's.

    Saves run before loads (a block evicted and reallocated in the same step is read before it is
    written), and both before the step's forward. Block ids are the device cache's (layer 0's, as in
    a block table); slots index the connector's own storage (host blocks, for offload; disk blocks, for
    its disk tier). Demotions (host slot -> disk slot: blocks the host tier evicts) run first of all,
    before this step's saves can land in those host slots."""

    save_block_ids: np.ndarray = field(default_factory=_no_ids)  # [S] int32: device blocks to copy out
    save_slots: np.ndarray = field(default_factory=_no_ids)  # [S] int32: where each goes
    load_block_ids: np.ndarray = field(default_factory=_no_ids)  # [L] int32: device blocks to fill
    load_slots: np.ndarray = field(default_factory=_no_ids)  # [L] int32: where each comes from
    demote_host_slots: np.ndarray = field(default_factory=_no_ids)  # [M] int32: host blocks leaving
    demote_disk_slots: np.ndarray = field(default_factory=_no_ids)  # [M] int32: where each goes
    disk_load_block_ids: np.ndarray = field(default_factory=_no_ids)  # [K] int32: device blocks to fill
    disk_load_slots: np.ndarray = field(default_factory=_no_ids)  # [K] int32: from these disk blocks
    # Device blocks written straight to disk slots: a persistent disk tier's shutdown only.
    disk_save_block_ids: np.ndarray = field(default_factory=_no_ids)  # [D] int32
    disk_save_slots: np.ndarray = field(default_factory=_no_ids)  # [D] int32
    # Disaggregated prefill (core/kv_transfer.py). A consumer's loads carry their bytes: per cache array,
    # [J, bytes per block] uint8 rows (a producer's blocks), written at inline_load_block_ids.
    inline_load_block_ids: np.ndarray = field(default_factory=_no_ids)  # [J] int32
    inline_blocks: tuple[np.ndarray, ...] = ()
    # A producer's sends, gathered after the step's forward (which completes their prompts): request
    # id, its prompt's full blocks, and the digest of the tokens they hold (the consumer checks it).
    sends: list[tuple[str, np.ndarray, str]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (
            len(self.save_block_ids)
            or len(self.load_block_ids)
            or len(self.demote_host_slots)
            or len(self.disk_load_block_ids)
            or len(self.disk_save_block_ids)
            or len(self.inline_load_block_ids)
            or self.sends
        )


@dataclass
class KVTransferStats:
    """What a connector moved, since the previous snapshot (tokens, bytes, seconds)."""

    num_queries: int = 0  # prompt tokens asked of the outside sources (past the device hit)
    num_hits: int = 0  # of those, tokens they provided (vLLM's external_prefix_cache_hits)
    num_disk_hits: int = 0  # of those, tokens a disk tier provided
    num_remote_hits: int = 0  # of those, tokens a producer provided (disaggregated prefill)
    num_blocks_saved: int = 0
    num_saves_skipped: int = 0  # evicted device blocks not saved: their step had no host slot left
    num_blocks_loaded: int = 0  # from the host tier
    num_blocks_demoted: int = 0  # host tier -> disk tier
    num_demotes_skipped: int = 0  # blocks the host tier evicted and dropped: their step had no disk slot left
    num_blocks_loaded_from_disk: int = 0
    bytes_saved: int = 0  # device -> outside
    bytes_loaded: int = 0  # host tier -> device
    bytes_demoted: int = 0  # host tier -> disk tier
    bytes_loaded_from_disk: int = 0  # disk tier -> device
    save_seconds: float = 0.0
    load_seconds: float = 0.0
    demote_seconds: float = 0.0
    disk_load_seconds: float = 0.0
    # Disaggregated prefill: a producer's blocks sent, a consumer's fetches (and those that failed or
    # timed out, after which it computed the prompt itself, and those its own caches made needless),
    # and the fetched blocks loaded into the device cache.
    num_blocks_sent: int = 0
    bytes_sent: int = 0
    send_seconds: float = 0.0
    num_remote_fetches: int = 0
    num_remote_fetch_failures: int = 0
    num_remote_fetches_cached: int = 0
    num_blocks_fetched: int = 0
    bytes_fetched: int = 0
    fetch_seconds: float = 0.0
    num_blocks_loaded_remote: int = 0
    bytes_loaded_remote: int = 0
    remote_load_seconds: float = 0.0

    # Whose stats these are (> 0: that connector's; both when they compose), so metrics name each's.
    offloaded: int = 0
    disaggregated: int = 0

    @property
    def is_offloaded(self) -> bool:
        return self.offloaded > 0

    @property
    def is_disaggregated(self) -> bool:
        return self.disaggregated > 0

    def add(self, other: KVTransferStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @classmethod
    def total(cls, snapshots: list[KVTransferStats | None]) -> KVTransferStats | None:
        """The sum of several connectors' (or stages') stats; None where none has any."""
        snapshots = [s for s in snapshots if s is not None]
        if not snapshots:
            return None
        stats = cls()
        for snapshot in snapshots:
            stats.add(snapshot)
        return stats


class KVConnectorScheduler:
    """The scheduler's half; this base is the connector that is off (nothing outside the device)."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Prompt tokens past the first `num_computed_tokens` (the device prefix hit) that the outside
        source can provide: whole blocks, leaving at least the last prompt token to compute. No side
        effect: the request may still fail to get its blocks."""
        return 0

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_computed_tokens: int, num_external_tokens: int
    ) -> None:
        """The request got its blocks (`block_ids`, its whole table): the `num_external_tokens` after the
        first `num_computed_tokens` are to be loaded into them before this step."""

    def on_block_evicted(self, block_hash: bytes, block_id: int) -> None:
        """The device prefix cache is reusing `block_id`, whose K/V was the prefix `block_hash`: the
        step being scheduled overwrites it (BlockPool's eviction listener)."""

    def build_connector_meta(self, scheduled: Sequence) -> KVConnectorMetadata | None:
        """The transfers of the step just scheduled (`scheduled`: its ScheduledRequests; None: none). A
        step that schedules nothing runs nothing, so a connector keeps what it has for the next one."""
        return None

    def request_finished(self, request: Request) -> dict | None:
        """A request finished: the kv_transfer_params its output carries (a producer's: where a
        consumer fetches its blocks), or None."""
        return None

    def update_connector_output(self, stats: KVTransferStats | None) -> None:
        """The worker's half's stats of a step (from ModelRunnerOutput)."""

    def make_stats(self) -> KVTransferStats | None:
        """Counters since the previous call (None: no connector)."""
        return None

    def take_events(self) -> list[KVCacheEvent]:
        """KV cache events (core/kv_events.py) of the connector's own tier since the last call, oldest
        first; [] with events off or no tier a router can hit."""
        return []

    def reset(self) -> None:
        """Forget everything held outside the device (the weights changed: that K/V is stale)."""

    def shutdown_plan(self, cached_blocks: list[tuple[bytes, int]]) -> KVConnectorMetadata | None:
        """At a clean shutdown, the copies that keep blocks past it (a persistent disk tier's), given the
        device cache's cached blocks as (hash, block id), least recently cached first; None: none.
        `shut_down` follows once the worker has run them."""
        return None

    def shut_down(self) -> None:
        """The engine is gone: write what outlives it, release what it held."""


class KVConnectorWorker:
    """The worker's half; this base is the connector that is off. `kv_cache` is the runner's cache
    pytree (each array [num_layers * num_blocks, block_size, ...]); methods that write it donate it
    and return the new one."""

    def save_kv(self, kv_cache, metadata: KVConnectorMetadata | None) -> None:
        """Start copying metadata.save_block_ids out of `kv_cache` (the step has not written them yet)."""

    def load_kv(self, kv_cache, metadata: KVConnectorMetadata | None):
        """`kv_cache` with metadata.load_block_ids filled from the connector's storage."""
        return kv_cache

    def take_stats(self) -> KVTransferStats | None:
        """Bytes and seconds since the previous call (None: no connector)."""
        return None

    def save_kv_after_forward(self, kv_cache, metadata: KVConnectorMetadata | None) -> None:
        """Start copying out blocks the step has just written (a producer's sends): after the forward and
        a drafter's step, which writes the drafter's cache rows of the step's tokens."""

    def warm_up(self, kv_cache):
        """Compile the transfer programs before the compile guard arms; returns the cache."""
        return kv_cache

    def keep_blocks(self, kv_cache, metadata: KVConnectorMetadata) -> None:
        """At shutdown, the copies the scheduler's half planned (`shutdown_plan`), done when this returns."""

    def close(self) -> None:
        """Release sockets and threads (the engine shuts down)."""
