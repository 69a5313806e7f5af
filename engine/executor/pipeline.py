"""The pipelined executors: the devices split into pipeline stages (pipeline_parallel_size > 1).

They own the stages through their runner (worker/pipeline_runner.py: one program per stage on its own
tensor_parallel_size devices, the hidden states handed on device to device) and answer the engine
core as the one-process executor does, the research stack included (worker/weight_update.py: a weight
goes to the stages holding it; sleep frees every stage's cache, and at level 2 its weights). On several
processes (nnodes > 1) process 0's is `MultiHostPipelineExecutor`: the others follow its steps
(executor/multihost.py) with a `PipelineExecutor` of their own stages, and the last stage's process
answers each step with what it sampled. The research stack runs there too, each process on its own
stages: `sleep`/`wake_up` as for tensor parallelism (process 0, then the others), an update in two
phases, since a process holds (and can check) only its own stages' weights: every process checks the
names against the whole model and the shapes of its own stages and builds their new weights
(`prepare_update`), and only once every one has are they installed (`commit_update`); a refusal on any
process drops every process's (`abort_update`), so nothing changes anywhere.

On one process the engine core keeps up to pipeline_parallel_size steps (micro-batches of different
requests) in flight (`max_concurrent_batches`), so the stages of consecutive steps overlap; across
processes one step at a time.
"""

from __future__ import annotations

import numpy as np

from xlaserve.executor.executor import Executor
from xlaserve.executor.follower_calls import Call, host_weights
from xlaserve.executor.multihost import MultiHostExecutor
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
    last stage sends back what it sampled; an update of the weights in two phases (module doc)."""

    runner_class = PipelineRunner

    def _answered(self, host: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.sender.receive_outputs(host)

    def update_weights(self, weights) -> list[str]:
        return self._in_two_phases(Call("prepare_update", weights=host_weights(weights)))

    def update_weights_from_path(self, path: str) -> list[str]:
        return self._in_two_phases(Call("prepare_update_from_path", (path,)))

    def _in_two_phases(self, prepare: Call) -> list[str]:
        """`prepare` on every process (the followers' at the same time as ours), then commit everywhere,
        or, where any process refused its part, abort everywhere and raise its error (a ValueError: a
        caller's name or shape, or a path a process cannot read)."""
        self.sender.send_call(prepare)
        try:
            names = prepare.run(self.runner)
        except Exception:  # the followers' answers are still to be read
            self.sender.call_failures(prepare)
            self._everywhere(Call("abort_update"))
            raise
        failures = self.sender.call_failures(prepare)
        if failures:
            self._everywhere(Call("abort_update"))
            raise ValueError(f"{'; '.join(failures)} (nothing changed on any process)")
        self._everywhere(Call("commit_update"))
        return names
