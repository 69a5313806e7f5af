"""The executor: the one object the engine core hands a step to."""

from __future__ import annotations

import numpy as np

from xlaserve.core.outputs import ModelRunnerOutput, ScheduledRequest
from xlaserve.worker.model_runner import ModelRunner
from xlaserve.worker.step_future import StepFuture


class Executor:
    """One process drives every device of the engine: a step goes straight to its model runner."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def execute(
        self, scheduled: list[ScheduledRequest], grammar_bitmask: np.ndarray | None = None
    ) -> ModelRunnerOutput:
        """Run one step and return what each scheduled request sampled. `grammar_bitmask`
        [len(scheduled), W] int32: the tokens each row may sample (structured outputs), or None."""
        return self.runner.execute(scheduled, grammar_bitmask)

    def execute_async(
        self, scheduled: list[ScheduledRequest], grammar_bitmask: np.ndarray | None = None
    ) -> StepFuture:
        """Dispatch one step; its outputs come from the future's `result()` (async scheduling)."""
        return self.runner.execute_async(scheduled, grammar_bitmask)

    def shutdown(self) -> None:
        """Release whatever the executor holds besides the runner (nothing, in one process)."""
