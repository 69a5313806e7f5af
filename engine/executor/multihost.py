"""Multi-host engines: process 0 sends each step to the other processes.

Every process holds the model's shards for its devices and runs the same jitted step; only process 0
schedules. Before each step it sends the step to the other processes over the step channel
(executor/step_channel.py); they run it and answer, so a process that diverged stops the engine with a
clear error instead of hanging. With pipeline stages on several processes (executor/pipeline.py) only
the last stage's process samples: the followers answer with their step's outputs instead (empty where
nothing was sampled). The research stack goes the same way, as a `Call` between steps
(executor/follower_calls.py).
"""

from __future__ import annotations

import logging

import jax
import numpy as np

from xlaserve.config import EngineConfig, ParallelConfig
from xlaserve.core.outputs import ModelRunnerOutput, ScheduledRequest
from xlaserve.executor.executor import Executor
from xlaserve.executor.follower_calls import Call, host_weights
from xlaserve.executor.step_channel import StepReceiver, StepSender
from xlaserve.worker import sleep_mode
from xlaserve.worker.loading import LoadedCheckpoint
from xlaserve.worker.model_runner import ModelRunner
from xlaserve.worker.step_future import StepFuture
from xlaserve.worker.step_output import make_output

logger = logging.getLogger(__name__)


class MultiHostExecutor(Executor):
    """Process 0's executor: each step is sent to every follower, run here, and checked against
    the followers' answers."""

    def __init__(self, config: EngineConfig, checkpoint: LoadedCheckpoint, devices=None):
        super().__init__(config, checkpoint, devices)
        self.sender: StepSender | None = None

    def start(self) -> None:
        """Warm up, then wait for the followers (each connects once its own warm-up is done), so
        every process compiles at the same time instead of one after the other."""
        super().start()
        parallel = self.config.parallel
        self.sender = StepSender(parallel.master_addr, step_port(parallel), parallel.nnodes - 1)

    def execute(
        self, scheduled: list[ScheduledRequest], grammar_bitmask: np.ndarray | None = None
    ) -> ModelRunnerOutput:
        if not scheduled:
            return ModelRunnerOutput()
        inputs = self.runner.prepare(scheduled, grammar_bitmask)
        for slot, lora in self.runner.lora.take_loads() if self.runner.lora is not None else ():
            self.sender.call(
                Call("put_lora_in_slot", (slot, lora.lora_name, lora.lora_int_id, lora.lora_path))
            )
        self.sender.send(inputs)
        host = self._answered(self.runner.run(inputs))
        return make_output(scheduled, host, inputs.failed_req_ids, self.runner.hooks)

    def _answered(self, host: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The step's outputs, once the followers have answered: every process sampled the same ids."""
        self.sender.check(host["token_ids"])
        return host

    def execute_async(
        self,
        scheduled: list[ScheduledRequest],
        grammar_bitmask: np.ndarray | None = None,
        kv_connector_metadata=None,
    ) -> StepFuture:
        """Synchronous here (EngineConfig turns async scheduling off for several processes): the
        followers' checksums are checked before the next step is sent. No KV connector runs on several
        hosts (EngineConfig refuses it): `kv_connector_metadata` is always None."""
        return StepFuture.done(self.execute(scheduled, grammar_bitmask))

    def update_weights(self, weights) -> list[str]:
        weights = host_weights(weights)
        return self._everywhere(Call("update_weights", weights=weights))

    def update_weights_from_path(self, path: str) -> list[str]:
        return self._everywhere(Call("update_weights_from_path", (path,)))

    def sleep(self, level: int) -> sleep_mode.MemoryReport:
        return self._everywhere(Call("sleep", (level,)))

    def wake_up(self) -> sleep_mode.MemoryReport:
        return self._everywhere(Call("wake_up"))

    def apply_model(self, func) -> list:
        raise self._no_python_call("apply_model")

    def collective_rpc(self, method, args: tuple, kwargs: dict):
        raise self._no_python_call("collective_rpc")

    def _no_python_call(self, what: str) -> ValueError:
        # A follower runs only the calls it knows by name (Call), and process 0's arrays span hosts.
        return ValueError(
            f"{what} runs on one host: the other processes of a multi-host engine "
            f"(nnodes={self.config.parallel.nnodes}) run only the engine's own calls"
        )

    def _everywhere(self, call: Call):
        """`call` here first (what it returns is process 0's), then on every follower."""
        result = call.run(self.runner)
        self.sender.call(call)
        return result

    def shutdown(self) -> None:
        """Release the followers: they leave their step loop."""
        if self.sender is not None:
            self.sender.close()
            self.sender = None


def step_port(parallel: ParallelConfig) -> int:
    """The step channel's port: the one after the jax.distributed coordinator's."""
    return parallel.master_port + 1


def follow(runner: ModelRunner, parallel: ParallelConfig) -> None:
    """A process of node_rank > 0: run each step process 0 sends, until it stops."""
    receiver = StepReceiver(parallel.master_addr, step_port(parallel), parallel.node_rank)
    logger.info("process %d: following process 0's steps", parallel.node_rank)
    is_pipelined = parallel.pipeline_parallel_size > 1
    try:
        while (inputs := receiver.recv()) is not None:
            if isinstance(inputs, Call):
                receiver.answer_call(_run_call(inputs, runner))
                continue
            host = runner.run(inputs)
            if is_pipelined:  # the last stage's process sampled; the others ran their stages only
                receiver.send_outputs(host)
            else:
                receiver.report(host["token_ids"])
    finally:
        receiver.close()


def _run_call(call: Call, runner: ModelRunner) -> str | None:
    """Run a research-stack call on this process's shards: None, or what failed."""
    try:
        call.run(runner)
    except Exception as e:  # answered to process 0, which stops the engine with it
        logger.exception("process %d: %s failed", jax.process_index(), call.method)
        return f"{type(e).__name__}: {e}"
    return None
