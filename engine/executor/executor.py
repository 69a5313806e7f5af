"""The executor: the one object the engine core hands a step to."""

from __future__ import annotations

from xlaserve.core.outputs import ModelRunnerOutput, ScheduledRequest
from xlaserve.worker.model_runner import ModelRunner


class Executor:
    """One process drives every device of the engine: a step goes straight to its model runner."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def execute(self, scheduled: list[ScheduledRequest]) -> ModelRunnerOutput:
        """Run one step and return what each scheduled request sampled."""
        return self.runner.execute(scheduled)

    def shutdown(self) -> None:
        """Release whatever the executor holds besides the runner (nothing, in one process)."""
