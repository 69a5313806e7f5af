"""The model runner's KV plumbing: how its device cache is laid out, and what moves blocks between that
cache and K/V held elsewhere.

Layout: the model's cache spec with the state-copy slots the memory budget fits, the host's KV cache
groups (core/kv_cache_spec.py), and, for layers of several windows, a cache slot per group position
(worker/kv_cache_groups.py). Connector: host offload with its persistent disk tier (worker/kv_offload.py)
and disaggregated prefill's transfers (worker/kv_transfer.py), each moving a block as `BlockLayout` says,
whatever copies and interleaving the device cache holds. `KVPlumbing` is the part of the runner that sets
these up (worker/model_runner.py; a pipeline's runner, worker/pipeline_runner.py, sizes a block over its
stages and gives the connector one cache per stage); the step only calls the connector it made.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from xlaserve.core.kv_offload import persistent_tier_dir
from xlaserve.worker.kv_cache import bytes_per_block, fit_state_copy_slots
from xlaserve.worker.kv_cache_groups import cache_layout, kv_cache_groups
from xlaserve.worker.kv_offload import BlockLayout
from xlaserve.worker.kv_transfer import make_kv_connector_worker


class KVPlumbing:
    """The model runner's KV cache layout and connector set-up (module doc); `ModelRunner` builds on it
    and calls it from `__init__`, once the model, its backend and the block sizes are known."""

    def _lay_out_kv_cache(self, max_model_len: int) -> None:
        config = self.config
        self.kv_spec = fit_state_copy_slots(
            self.kv_spec,
            config,
            self.backend.cache_dtype(self.dtype),
            self.cache_block_size,
            max_model_len if config.model.max_model_len is not None else None,
        )
        # The host's KV cache groups (core/kv_cache_spec.py), from the model's cache spec.
        self.kv_cache_groups = kv_cache_groups(self.kv_spec, self.model_config, config)
        # Layers of several windows: a block table per group, and a cache slot per group position
        # rather than per layer (worker/kv_cache_groups.py); None: a slot per layer, one table.
        self.cache_layout = cache_layout(self.kv_cache_groups)
        if self.cache_layout is not None:
            self.kv_spec = dataclasses.replace(self.kv_spec, num_layers=self.cache_layout.num_slots)

    def _set_up_kv_connector(self, kv_heads: int) -> None:
        """The configured connector's worker half over the cache (worker/kv_transfer.py), or the base
        class, which moves nothing (`kv_heads`: the model's, each moved once)."""
        self.kv_layout = BlockLayout(kv_heads, self.dcp)
        if self.drafter is not None:  # its cache's rows of a block move with the target's (`moved_kv_cache`)
            self.kv_layout = (self.kv_layout, BlockLayout(self.drafter.kv_heads))
        # Named once here (it stats the checkpoint's files): the core's half reads it from the executor.
        self.kv_persist_dir = persistent_tier_dir(self.config, self.kv_bytes_per_block())
        self.kv_connector = make_kv_connector_worker(
            self.config.cache,
            self.kv_bytes_per_block(),
            self.num_blocks,
            self.kv_layout,
            self.kv_persist_dir,
            local_stages=self._connector_stages(),
            kv_transfer=self.config.kv_transfer,
        )

    def _connector_stages(self) -> list[bool] | None:
        """Per pipeline stage, whether this process runs it (None: no stages, one cache)."""
        return None

    @property
    def moved_kv_cache(self):
        """What the connector moves a block of: the runner's cache, and with a drafter (a draft model, an
        MTP or EAGLE-3 layer) a tuple of it and the drafter's own, which the same block ids index: a
        block leaving the device, coming back or crossing to a consumer carries its rows in both, as
        `kv_layout` lays them out (worker/kv_offload.py `cache_arrays`)."""
        if self.drafter is None:
            return self.kv_cache
        return (self.kv_cache, self.drafter.kv_cache)

    @moved_kv_cache.setter
    def moved_kv_cache(self, caches) -> None:
        if self.drafter is None:
            self.kv_cache = caches
        else:
            self.kv_cache, self.drafter.kv_cache = caches

    def kv_bytes_per_block(self) -> int:
        """Bytes of one block as the KV connector moves it (to a host tier, to a consumer): every layer's
        K/V of block_size tokens, each of the model's KV heads once (`BlockLayout`), whatever copies and
        interleaving the device cache holds; a drafter's rows of the block too."""
        if self.drafter is None:
            return self._moved_bytes_per_block(self.kv_spec, self.kv_layout)
        return sum(
            self._moved_bytes_per_block(spec, layout)
            for spec, layout in zip((self.kv_spec, self.drafter.kv_spec), self.kv_layout, strict=True)
        )

    def _moved_bytes_per_block(self, spec, layout: BlockLayout) -> int:
        dtype = self.backend.cache_dtype(self.dtype)
        if spec.layer_kind != "full_attention" or spec.fixed_num_tokens is not None:
            return bytes_per_block(spec, self.cache_block_size, dtype)  # a cache no connector moves
        num_layers, *block = spec.shape(1, self.cache_block_size)
        moved = layout.moved_shape(tuple(block))
        return spec.num_arrays * num_layers * math.prod(moved) * np.dtype(dtype).itemsize
