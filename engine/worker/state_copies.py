"""Copies between state slots around a step's forward: the prefix cache of models that keep a state.

A state layer's slot summarizes every token before it, so a prefix hit needs the state at the hit's
position: the scheduler snapshots a request's live slot when a step ends on a block boundary of its
prompt, and copies a snapshot into a later request's live slot when that request hits it
(core/kv_cache_coordinator.py `StateGroupBlocks`). Each ScheduledRequest carries its `StateCopy`; this
module turns a step's copies into (src, dst) slot lists and runs them on the device: the copies in
before the forward (a hit's first step reads the copied state; a step verifying drafts keeps a backup
of the state entering it, which a rejected draft restores before the next forward), the copies out
after it (a snapshot holds the state the forward left). One jitted program, the cache donated, per
power-of-two count of copies; the mixers and the steps without copies are untouched.
"""

from __future__ import annotations

import logging
import time

import jax
import numpy as np

logger = logging.getLogger(__name__)


def copy_buckets(max_num_seqs: int) -> list[int]:
    """The copy counts programs are compiled for: powers of two, and max_num_seqs (at most one copy
    in and one out per request of a step)."""
    buckets, size = [], 1
    while size < max_num_seqs:
        buckets.append(size)
        size *= 2
    return [*buckets, max_num_seqs]


def step_state_copies(scheduled, failed: set[str]) -> tuple[np.ndarray, np.ndarray] | None:
    """(copies in [2, n], copies out [2, m]) int32 rows (src, dst) of a step's requests, or None when
    there are none. A request whose rows failed copies nothing (its snapshot is not indexed)."""
    copies_in, copies_out = [], []
    for s in scheduled:
        copy = s.state_copy
        if copy is None or s.request_id in failed:
            continue
        copies_in.extend(copy.copies_before)
        if copy.copy_out is not None:
            copies_out.append(copy.copy_out)
    if not copies_in and not copies_out:
        return None
    return tuple(np.asarray(c, np.int32).reshape(-1, 2).T for c in (copies_in, copies_out))


class StateCopier:
    """The copy programs of a cache whose spec has `copy_state_slots` (kernels/ssd.py, hybrid_cache.py)."""

    def __init__(self, kv_spec, max_num_seqs: int):
        self.kv_spec = kv_spec
        self.buckets = copy_buckets(max_num_seqs)
        self._fn = None

    def _program(self, kv_cache):
        if self._fn is None:
            shardings = jax.tree.map(lambda a: a.sharding, kv_cache)
            self._fn = jax.jit(self.kv_spec.copy_state_slots, donate_argnums=0, out_shardings=shardings)
        return self._fn

    def apply(self, kv_cache, pairs: np.ndarray):
        """The cache (donated) with slot pairs[0][i] copied to pairs[1][i]; nothing when there are none."""
        num_copies = pairs.shape[1]
        if not num_copies:
            return kv_cache
        size = next(b for b in self.buckets if b >= num_copies)
        padded = np.zeros((2, size), np.int32)  # (0, 0): the null slot onto itself
        padded[:, :num_copies] = pairs
        return self._program(kv_cache)(kv_cache, padded[0], padded[1])

    def warm_up(self, kv_cache):
        """Compile every count's program, copying the null slot onto itself (twice: the second call
        sees the cache as a step leaves it)."""
        t0 = time.perf_counter()
        for size in self.buckets:
            for _ in range(2):
                kv_cache = self.apply(kv_cache, np.zeros((2, size), np.int32))
        jax.block_until_ready(kv_cache)
        logger.info(
            "state snapshots: %d copy programs (%s copies) ready in %.2fs",
            len(self.buckets),
            self.buckets,
            time.perf_counter() - t0,
        )
        return kv_cache


class StageStateCopier:
    """A pipeline's copies (worker/pipeline_runner.py): the same slot pairs on every stage's cache (a
    list; None for another process's stage), each by its own program on its devices. A stage holding no
    state layer has nothing to copy."""

    def __init__(self, stage_specs: list, max_num_seqs: int):
        self.copiers = [
            StateCopier(spec, max_num_seqs) if spec is not None and spec.state_layers else None
            for spec in stage_specs
        ]

    def apply(self, kv_caches: list, pairs: np.ndarray) -> list:
        return [cache if c is None else c.apply(cache, pairs) for c, cache in zip(self.copiers, kv_caches)]

    def warm_up(self, kv_caches: list) -> list:
        return [cache if c is None else c.warm_up(cache) for c, cache in zip(self.copiers, kv_caches)]
