"""How a step reaches the devices, and who reads the model for them: `Executor` runs a step in this
process; `MultiHostExecutor` (process 0 of a multi-host engine) also sends it to the other processes,
which `follow` it."""

from __future__ import annotations

import jax

from xlaserve.config import EngineConfig
from xlaserve.executor.executor import Executor
from xlaserve.executor.multihost import MultiHostExecutor, follow
from xlaserve.executor.pipeline import MultiHostPipelineExecutor, PipelineExecutor
from xlaserve.executor.step_channel import ProcessZeroLost
from xlaserve.worker.loading import LoadedCheckpoint, ModelInfo
from xlaserve.worker.step_future import StepFuture


def executor_class(config: EngineConfig) -> type[Executor]:
    """Multi-host on process 0 of several processes (its pipelined kind with pipeline_parallel_size > 1),
    pipelined with pipeline_parallel_size > 1, else one process (a follower's steps come from `follow`,
    not from an engine core; a pipelined follower runs its own stages with a PipelineExecutor's runner)."""
    if config.parallel.nnodes > 1 and config.parallel.node_rank == 0:
        return MultiHostPipelineExecutor if config.parallel.pipeline_parallel_size > 1 else MultiHostExecutor
    if config.parallel.pipeline_parallel_size > 1:
        return PipelineExecutor
    return Executor


def load_model(config: EngineConfig) -> LoadedCheckpoint:
    """Read the model once for the whole engine, as its executor class reads it."""
    return executor_class(config).load(config)


def make_executor(config: EngineConfig, checkpoint: LoadedCheckpoint, devices=None) -> Executor:
    """The executor for `config`, its runner built from `checkpoint` on `devices` (None: all)."""
    return executor_class(config)(config, checkpoint, devices)


def device_groups(config: EngineConfig, devices=None) -> list:
    """The devices of each data-parallel rank: tensor_parallel_size x pipeline_parallel_size each, in
    order ([None]: one rank, every device); ValueError when there are too few."""
    parallel = config.parallel
    tp, pp, dp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size, parallel.data_parallel_size
    if dp == 1:
        return [devices]
    devices = list(jax.devices() if devices is None else devices)
    per_rank = tp * pp
    if per_rank * dp > len(devices):
        sizes = f"tensor_parallel_size={tp} x " + (f"pipeline_parallel_size={pp} x " if pp > 1 else "")
        raise ValueError(
            f"{sizes}data_parallel_size={dp} needs {per_rank * dp} devices, {len(devices)} available"
        )
    return [devices[i * per_rank : (i + 1) * per_rank] for i in range(dp)]


__all__ = [
    "Executor",
    "LoadedCheckpoint",
    "ModelInfo",
    "MultiHostExecutor",
    "MultiHostPipelineExecutor",
    "PipelineExecutor",
    "ProcessZeroLost",
    "StepFuture",
    "device_groups",
    "executor_class",
    "follow",
    "load_model",
    "make_executor",
]
