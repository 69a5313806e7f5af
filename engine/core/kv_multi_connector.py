"""Several KV connectors as one (vLLM's MultiConnector): host offload and disaggregated prefill on one
engine (README "Disaggregated prefill").

The scheduler and the runner still talk to one connector at the same fixed points; this one hands each
call to its connectors, in the order of the sources of a prompt's K/V. After the device prefix hit, the
first connector (the host tier) is asked for the blocks that follow it, the next (a producer's fetched
blocks) for those that follow those, and so on: each serves the tokens the ones before it lacked, so a
consumer whose host tier holds a returning conversation's prefix loads only the rest from its producer
(engine/engine/kv_fetch.py does not even fetch what its own caches hold), and a producer whose host tier
holds a prompt's prefix computes only the rest, then sends every block of it.

The connectors' step plans touch disjoint fields of `KVConnectorMetadata` (offload's saves, loads and
demotions; disaggregated prefill's inline loads and sends), so the step's plan is their union, and each
worker half reads its own fields of it. The runner's order holds for all of them together: every save
(blocks evicted this step) before any load, every load before the forward, sends after it.
Plain data and plain Python: no jax here.
"""

from __future__ import annotations

from dataclasses import fields

import numpy as np

from xlaserve.core.kv_connector import (
    KVConnectorMetadata,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVTransferStats,
)
from xlaserve.core.kv_events import KVCacheEvent
from xlaserve.core.request import Request


def merge_metadata(metas: list[KVConnectorMetadata | None]) -> KVConnectorMetadata | None:
    """One step's plan from each connector's (None: nothing to do)."""
    metas = [m for m in metas if m is not None]
    if len(metas) < 2:
        return metas[0] if metas else None
    merged = KVConnectorMetadata()
    for f in fields(KVConnectorMetadata):
        values = [getattr(m, f.name) for m in metas]
        if isinstance(values[0], np.ndarray):
            setattr(merged, f.name, np.concatenate(values))
        elif f.name == "inline_blocks":  # per cache array
            parts = [v for v in values if v]
            setattr(merged, f.name, tuple(np.concatenate(p) for p in zip(*parts)) if parts else ())
        else:
            setattr(merged, f.name, [item for v in values for item in v])
    return merged


class MultiConnectorScheduler(KVConnectorScheduler):
    """The scheduler's halves of `connectors`, asked in that order for a prompt's blocks."""

    def __init__(self, connectors: list[KVConnectorScheduler]):
        self.connectors = connectors

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        num_matched = 0
        for connector in self.connectors:
            num_matched += connector.get_num_new_matched_tokens(request, num_computed_tokens + num_matched)
        return num_matched

    def update_state_after_alloc(self, request, block_ids, num_computed_tokens, num_external_tokens) -> None:
        # Each connector's share, as get_num_new_matched_tokens split it (nothing it reads has changed
        # since: a connector's index changes only in build_connector_meta); every connector hears of the
        # request, with 0 tokens too (a consumer's fetched blocks are dropped then: a recompute computes).
        for connector in self.connectors:
            share = min(
                connector.get_num_new_matched_tokens(request, num_computed_tokens), num_external_tokens
            )
            connector.update_state_after_alloc(request, block_ids, num_computed_tokens, share)
            num_computed_tokens += share
            num_external_tokens -= share

    def on_block_evicted(self, block_hash: bytes, block_id: int) -> None:
        for connector in self.connectors:
            connector.on_block_evicted(block_hash, block_id)

    def build_connector_meta(self, scheduled) -> KVConnectorMetadata | None:
        return merge_metadata([c.build_connector_meta(scheduled) for c in self.connectors])

    def request_finished(self, request: Request) -> dict | None:
        params = [p for c in self.connectors if (p := c.request_finished(request)) is not None]
        return params[0] if params else None

    def update_connector_output(self, stats: KVTransferStats | None) -> None:
        for connector in self.connectors:  # each reads its own fields of the workers' stats
            connector.update_connector_output(stats)

    def make_stats(self) -> KVTransferStats | None:
        snapshots = [c.make_stats() for c in self.connectors]
        stats = KVTransferStats.total(snapshots)
        if stats is None:
            return None
        # Every request past its device hit asks the first source; the later ones are asked only for
        # what it lacked, so the prompt tokens queried are the first's count.
        stats.num_queries = next(s for s in snapshots if s is not None).num_queries
        return stats

    def take_events(self) -> list[KVCacheEvent]:
        return [event for connector in self.connectors for event in connector.take_events()]

    def reset(self) -> None:
        for connector in self.connectors:
            connector.reset()

    def shutdown_plan(self, cached_blocks: list[tuple[bytes, int]]) -> KVConnectorMetadata | None:
        return merge_metadata([c.shutdown_plan(cached_blocks) for c in self.connectors])

    def shut_down(self) -> None:
        for connector in self.connectors:
            connector.shut_down()


class MultiConnectorWorker(KVConnectorWorker):
    """The worker's halves of the same connectors, each given the whole step plan (it reads its own
    fields): every save before any load, as the runner orders one connector's."""

    def __init__(self, workers: list[KVConnectorWorker]):
        self.workers = workers

    def save_kv(self, kv_cache, metadata: KVConnectorMetadata | None) -> None:
        for worker in self.workers:
            worker.save_kv(kv_cache, metadata)

    def load_kv(self, kv_cache, metadata: KVConnectorMetadata | None):
        for worker in self.workers:
            kv_cache = worker.load_kv(kv_cache, metadata)
        return kv_cache

    def save_kv_after_forward(self, kv_cache, metadata: KVConnectorMetadata | None) -> None:
        for worker in self.workers:
            worker.save_kv_after_forward(kv_cache, metadata)

    def take_stats(self) -> KVTransferStats | None:
        return KVTransferStats.total([w.take_stats() for w in self.workers])

    def warm_up(self, kv_cache):
        for worker in self.workers:
            kv_cache = worker.warm_up(kv_cache)
        return kv_cache

    def keep_blocks(self, kv_cache, metadata: KVConnectorMetadata) -> None:
        for worker in self.workers:
            worker.keep_blocks(kv_cache, metadata)

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
