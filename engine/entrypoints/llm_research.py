"""The offline `LLM`'s research stack (README "Python API"): weights from a trainer (`update_weights`),
device memory handed back between its steps (`sleep`, `wake_up`), the profiler, and a user's code on the
model (`apply_model`, `collective_rpc`), as vLLM's LLM has them.

`ResearchMethods` is a part of `LLM` (entrypoints/llm.py), which builds on it: its methods use the
engine core and output processor `LLM.__init__` sets, and `LLM._record_stats` (the sleep state the
metrics show comes with the core's stats).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from xlaserve.engine.protocol import SleepMode


class ResearchMethods:
    """`LLM`'s research stack (module doc)."""

    def update_weights(self, weights) -> list[str]:
        """Load new weights into the running engine, without a restart or a recompile (vLLM's
        `load_weights`): `weights` is a dict or an iterable of (Hugging Face name, array) pairs, numpy
        or jax, all of the model's tensors or some. Every name and shape is checked first: an unknown
        name or a wrong shape is a ValueError naming both, and the old weights stay. The prefix cache
        is reset (its K/V came from the old weights). -> the names updated."""
        return self.engine_core.update_weights(weights)

    def update_weights_from_path(self, path: str) -> list[str]:
        """`update_weights` with the checkpoint at `path` (same architecture and shapes)."""
        return self.engine_core.update_weights_from_path(path)

    def sleep(self, level: int = 1, mode: SleepMode = "abort"):
        """Free the KV cache's device memory (level 2: the weights' too, kept on the host) until
        `wake_up()`; requests meanwhile are refused, and those unfinished go by `mode` (vLLM's: abort,
        keep, wait; EngineCore.sleep). -> what was freed (`device_bytes`, `seconds`)."""
        report = self.engine_core.sleep(level, mode)
        self.output_processor.process_outputs(self.engine_core.take_outputs())  # what it aborted ends
        self._record_stats()
        return report

    def start_profile(self) -> None:
        """Start a jax.profiler trace into `profiler_dir` (an engine argument): the engine's programs and
        host work until `stop_profile`, for TensorBoard's profile plugin or Perfetto."""
        self.engine_core.start_profile()

    def stop_profile(self) -> str:
        """Write the trace; -> the folder it is under (plugins/profile/<run>/)."""
        return self.engine_core.stop_profile()

    def wake_up(self):
        """Place back what `sleep` freed (the KV cache zeroed, the prefix cache empty)."""
        report = self.engine_core.wake_up()
        self._record_stats()
        return report

    def is_sleeping(self) -> bool:
        return self.engine_core.is_sleeping

    # -- a user's code on the model, in this process (vLLM's apply_model and collective_rpc) -------

    def apply_model(self, func: Callable[[Any], Any]) -> list:
        """`func(model)` on the model as the engine runs it: a Flax NNX module (`nnx.merge` of the
        runner's graphdef and weights) whose arrays are the engine's own, in its layouts and shardings
        (quantized, or packed for the CPU's dot, where the engine holds them so). -> one result per
        module: one, or one per pipeline stage and per data-parallel rank (vLLM's one per worker).
        The module is a view: what `func` assigns to it is not written back (`update_weights` writes
        weights). Not on an engine asleep, nor across hosts (nnodes > 1)."""
        return self.engine_core.apply_model(func)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> list:
        """The model runner's `method` (a name), or `method(runner, *args, **kwargs)` (a callable),
        on each data-parallel rank's runner: -> one result per rank. The runner is this process's
        (worker/model_runner.py): no remote call, so no `timeout`. Not across hosts (nnodes > 1)."""
        if timeout is not None:
            raise ValueError("collective_rpc: timeout must be None: the runners are in this process")
        return self.engine_core.collective_rpc(method, args, kwargs)
