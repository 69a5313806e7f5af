"""How a step reaches the devices: `Executor` runs it in this process; `MultiHostExecutor` (process 0
of a multi-host engine) also sends it to the other processes, which `follow` it."""

from xlaserve.config import EngineConfig
from xlaserve.executor.executor import Executor
from xlaserve.executor.multihost import MultiHostExecutor, follow
from xlaserve.worker.model_runner import ModelRunner


def make_executor(config: EngineConfig, runner: ModelRunner) -> Executor:
    """The executor for `config`: multi-host on process 0 of several processes, else one process
    (a follower's steps come from `follow`, not from an engine core)."""
    if config.parallel.nnodes > 1 and config.parallel.node_rank == 0:
        return MultiHostExecutor(runner, config.parallel)
    return Executor(runner)


__all__ = ["Executor", "MultiHostExecutor", "follow", "make_executor"]
