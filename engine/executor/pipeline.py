"""The pipelined executors: the devices split into pipeline stages (pipeline_parallel_size > 1).

They own the stages through their runner (worker/pipeline_runner.py: one program per stage on its own
tensor_parallel_size devices, the hidden states handed on device to device) and answer the engine
core as the one-process executor does, the research stack included (worker/weight_update.py: a weight
goes to the stages holding it; sleep frees every stage's cache, and at level 2 its weights). On several
processes (nnodes > 1) process 0's is `MultiHostPipelineExecutor`: the others follow its steps
(executor/multihost.py) with a `PipelineExecutor` of their own stages, and the last stage's process
answers each step with what it sampled; the research stack is refused there (a process holds only its
own stages' weights, and the calls would route names to stages it does not hold).

On one process the engine core keeps up to pipeline_parallel_size steps (micro-batches of different
requests) in flight (`max_concurrent_batches`), so the stages of consecutive steps overlap; across
processes one step at a time.
"""

from __future__ import annotations

import numpy as np

from xlaserve.executor.executor import Executor
from xlaserve.executor.multihost import Call, MultiHostExecutor
from xlaserve.worker.pipeline_runner import PipelineRunner


class PipelineExecutor(Executor):
    """One process drives every stage; a step runs the stages in order and samples on the last."""

    runner_class = PipelineRunner

    @property
    def max_concurrent_batches(self) -> int:
        """One micro-batch per stage: while stage s runs step k, stage s - 1 runs step k + 1."""
        return self.config.parallel.pipeline_parallel_size


class MultiHostPipelineExecutor(MultiHostExecutor):
    """Process 0 of a pipeline over several processes: it runs its own stages, and the process of the
    last stage sends back what it sampled (the research stack: refused)."""

    runner_class = PipelineRunner

    def _answered(self, host: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.sender.receive_outputs(host)

    def _everywhere(self, call: Call):
        raise ValueError(
            f"{call.method} is not supported on pipeline stages across processes yet: run the stages on "
            "one host (or tensor parallelism across hosts)"
        )
