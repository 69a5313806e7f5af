"""The pipelined executor: one host's devices split into pipeline stages (pipeline_parallel_size > 1).

It owns the stages through its runner (worker/pipeline_runner.py: one program per stage on its own
tensor_parallel_size devices, the hidden states handed on device to device) and answers the engine
core as the one-process executor does; what the stages cannot do yet is refused here by name.
"""

from __future__ import annotations

from xlaserve.executor.executor import Executor
from xlaserve.worker.pipeline_runner import PipelineRunner


class PipelineExecutor(Executor):
    """One process drives every stage; a step runs the stages in order and samples on the last."""

    runner_class = PipelineRunner

    def update_weights(self, weights) -> list[str]:
        raise _not_pipelined("update_weights")

    def update_weights_from_path(self, path: str) -> list[str]:
        raise _not_pipelined("update_weights_from_path")

    def sleep(self, level: int):
        raise _not_pipelined("sleep")


def _not_pipelined(what: str) -> ValueError:
    """The research stack swaps or frees one model's arrays: the stages' are not wired to it yet."""
    return ValueError(f"{what} is not supported with pipeline_parallel_size > 1 yet")
