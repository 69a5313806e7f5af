"""A running engine's device memory handed back and restored (the research stack, vLLM's sleep mode).

`sleep(runner, level)` deletes the KV cache's device buffers (every stage's, and a speculative drafter's
cache; level 2: every parameter set's weights too, and the drafter's own, kept on the host, each process
its own shards) and `wake_up(runner)` allocates and places them again; what a slept cache held is gone,
so the core resets its prefix cache. Another process's pipeline stage (a `ParamSet` without params) is
that process's to free.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from xlaserve.worker.weight_update import shard_key


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """What a sleep freed or a wake-up placed back: device bytes and seconds."""

    level: int
    device_bytes: int
    seconds: float


def _device_bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))


@dataclasses.dataclass(frozen=True)
class _HostCopy:
    """An array's shards that this process holds, on the host: one copy per distinct shard (replicas
    share it), and which one each device gets back."""

    shape: tuple[int, ...]
    sharding: jax.sharding.Sharding
    data: dict[tuple, np.ndarray]
    devices: list[tuple[object, tuple]]

    @classmethod
    def of(cls, a: jax.Array) -> _HostCopy:
        data, devices = {}, []
        for s in a.addressable_shards:
            key = shard_key(s.index, a.shape)
            if key not in data:
                data[key] = np.asarray(s.data)
            devices.append((s.device, key))
        return cls(a.shape, a.sharding, data, devices)

    def placed(self) -> jax.Array:
        arrays = [jax.device_put(self.data[key], device) for device, key in self.devices]
        return jax.make_array_from_single_device_arrays(self.shape, self.sharding, arrays)


def _on_host(tree):
    """A tree's arrays copied to the host shard by shard (a tree: a head may be packed for the CPU's dot,
    kernels/cpu_dot.py; None stays None). Across hosts each process keeps its own shards."""
    return jax.tree.map(_HostCopy.of, tree)


def _placed(saved):
    """`_on_host`'s tree placed back on its devices."""
    return jax.tree.map(lambda copy: copy.placed(), saved, is_leaf=lambda x: isinstance(x, _HostCopy))


def sleep(runner, level: int) -> MemoryReport:
    """Free the KV cache's device buffers (every stage's; level 2: every parameter set's weights too,
    kept on the host)."""
    start = time.perf_counter()
    freed = _device_bytes(runner.kv_cache)
    for leaf in jax.tree.leaves(runner.kv_cache):
        leaf.delete()
    runner.kv_cache = None
    drafter = runner.drafter
    if drafter is not None:
        freed += drafter.free_cache()
    if level == 2:
        sets = runner.param_sets()
        freed += _device_bytes([(weights.params, weights.head_dv) for weights in sets])
        runner.slept_weights = [
            (weights, _on_host(weights.params), _on_host(weights.head_dv)) for weights in sets
        ]
        for weights in sets:
            for leaf in jax.tree.leaves((weights.params, weights.head_dv)):
                leaf.delete()
        if drafter is not None:
            freed += _device_bytes(drafter.own_weights)
            runner.slept_drafter = _on_host(drafter.own_weights)
            for leaf in jax.tree.leaves(drafter.own_weights):
                leaf.delete()
    return MemoryReport(level, freed, time.perf_counter() - start)


def wake_up(runner) -> MemoryReport:
    """Place back what `sleep` freed: a zeroed KV cache of the same blocks, and the weights."""
    start = time.perf_counter()
    placed = 0
    if runner.slept_weights is not None:
        sets = []
        for weights, saved_params, saved_head in runner.slept_weights:
            params, head_dv = _placed(saved_params), _placed(saved_head)
            sets.append(dataclasses.replace(weights, params=params, head_dv=head_dv))
            placed += _device_bytes((params, head_dv))
        runner.slept_weights = None
        if runner.slept_drafter is not None:  # before the target's: set_param_sets hands them on
            runner.drafter.own_weights = _placed(runner.slept_drafter)
            placed += _device_bytes(runner.drafter.own_weights)
            runner.slept_drafter = None
        runner.set_param_sets(sets)
    runner.kv_cache = runner.allocate_kv_cache()
    placed += _device_bytes(runner.kv_cache)
    if runner.drafter is not None:
        runner.drafter.reallocate()
        placed += _device_bytes((runner.drafter.kv_cache, runner.drafter.q_buf))
    return MemoryReport(0, placed, time.perf_counter() - start)
