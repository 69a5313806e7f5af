"""The executor: the one object the engine core hands a step to, and the owner of the model it runs.

It reads the checkpoint (`load`, once per engine: data-parallel ranks share it) and builds its runner
from it, so the engine core never imports a loader and an executor that splits the model differently
(pipeline stages) reads what it needs its own way.
"""

from __future__ import annotations

import jax
import numpy as np

from xlaserve.config import EngineConfig
from xlaserve.core.encoder_cache_manager import EncoderCacheLayout
from xlaserve.core.kv_cache_spec import KVCacheGroup, context_blocks
from xlaserve.core.kv_connector import KVConnectorMetadata
from xlaserve.core.outputs import ModelRunnerOutput, ScheduledRequest
from xlaserve.lora_request import LoRARequest
from xlaserve.worker import sleep_mode, weight_update
from xlaserve.worker.kv_cache import fit_max_model_len
from xlaserve.worker.loading import LoadedCheckpoint, load_for_engine
from xlaserve.worker.model_runner import ModelRunner
from xlaserve.worker.step_future import StepFuture


class Executor:
    """One process drives every device of the engine: a step goes straight to its model runner.

    Everything the engine core asks of the devices is a method or property here (capacities, limits,
    LoRA checks, what the pooler allows, steps, the research stack): the core never sees a runner, so
    an executor that runs the model differently (pipeline stages) fits behind the same interface."""

    runner_class = ModelRunner

    def __init__(self, config: EngineConfig, checkpoint: LoadedCheckpoint, devices=None):
        self.config = config
        self.runner = self.runner_class(
            config,
            checkpoint.hf_config,
            checkpoint.tensors,
            checkpoint.max_model_len,
            devices,
            pooler=checkpoint.pooler,
        )

    @classmethod
    def load(cls, config: EngineConfig) -> LoadedCheckpoint:
        """Read the model `config` names (joining the other processes first, if any)."""
        return load_for_engine(config)

    # -- capacities, known once the runner holds its weights and KV cache -------------------------

    @property
    def num_kv_blocks(self) -> int:
        """Blocks of the KV cache, the null block included."""
        return self.runner.num_blocks

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a step needs past its tokens (a draft model's drafts), 0 without one."""
        return self.runner.num_lookahead_tokens

    def set_max_model_len(self, max_model_len: int) -> None:
        """Lower the context to what the KV cache holds (the engine core decides)."""
        self.runner.set_max_model_len(max_model_len)

    def fit_max_model_len(self, *, is_user_set: bool) -> int:
        """The context the KV cache can serve (worker/kv_cache.fit_max_model_len: a user's length it
        cannot hold is a ValueError naming both numbers; the model's own is lowered), applied here."""
        max_model_len = fit_max_model_len(
            self.max_model_len,
            # The null block holds no request's tokens; a state-only model's one slot holds any length.
            context_blocks(self.kv_cache_groups, self.num_kv_blocks - 1, self.max_model_len),
            self.config.cache.block_size,
            is_user_set=is_user_set,
        )
        if max_model_len != self.max_model_len:
            self.set_max_model_len(max_model_len)
        return max_model_len

    @property
    def max_concurrent_batches(self) -> int:
        """Steps of different requests worth keeping in flight at once (vLLM's name): more than one
        where the devices run a step in parts that can overlap (pipeline stages), else 1."""
        return 1

    @property
    def runs_on_host_cpu(self) -> bool:
        """The engine's devices are this host's CPU cores: the host's own work (scheduling the next
        step) runs on the cores a step computes on."""
        return next(iter(self.runner.mesh.devices.flat)).platform == "cpu"

    @property
    def kv_cache_groups(self) -> tuple[KVCacheGroup, ...]:
        """The model's layer groups and their kinds, for the KV cache manager (core/kv_cache_spec.py)."""
        return self.runner.kv_cache_groups

    @property
    def kv_bytes_per_block(self) -> int:
        """Device bytes of one block id across every layer (sizes a KV connector's host tier)."""
        return self.runner.kv_bytes_per_block()

    @property
    def kv_persist_dir(self) -> str | None:
        """A persistent disk tier's directory (core/kv_offload.py `persistent_tier_dir`), as the runner's
        connector named it; None: no persistent tier."""
        return self.runner.kv_persist_dir

    @property
    def weight_bytes(self) -> int:
        """The weights' bytes on the devices, a drafter's too (the /metrics gauge
        xlaserve:model_weight_bytes)."""
        return self.runner.loaded_weight_bytes

    # -- what a pooling model allows (worker/pooler.py); a generate model has no pooler -----------

    @property
    def is_prefix_cacheable(self) -> bool:
        """False for a pooler that reads every prompt token's hidden state (MEAN/CLS/ALL, encoders)."""
        pooler = self.runner.pooler
        return pooler is None or pooler.is_prefix_cacheable

    @property
    def is_encoder(self) -> bool:
        """An encoder's prompt runs whole in one step (no chunked prefill)."""
        return self.runner.pooler is not None and self.runner.pooler.is_encoder

    @property
    def encoder_cache_layout(self) -> EncoderCacheLayout | None:
        """The device's encoder cache of a vision-language model (worker/mm_encoder.py); None: text only."""
        return self.runner.encoder_cache_layout

    # -- LoRA (worker/lora_manager.py) ---------------------------------------------------------------

    def check_lora(self, lora_request: LoRARequest) -> None:
        """ValueError (naming the adapter and the field) unless LoRA is on and the adapter is servable."""
        if self.runner.lora is None:
            raise ValueError("lora_request: LoRA is not enabled (start the engine with enable_lora=True)")
        self.runner.lora.check(lora_request)

    def lora_slots(self) -> tuple[dict, dict] | None:
        """(the slots' layout {stack: {module: shape}}, {stack: range of HF layers}) with LoRA on, for
        the front end to refuse an adapter the model cannot take; None with LoRA off."""
        lora = self.runner.lora
        return None if lora is None else (lora.layout, lora.layer_stacks)

    def start(self) -> None:
        """Compile every step program (unless enforce_eager), before the first request."""
        if not self.config.compilation.enforce_eager:
            self.runner.warm_up()

    # -- steps -----------------------------------------------------------------------------------

    def execute(
        self, scheduled: list[ScheduledRequest], grammar_bitmask: np.ndarray | None = None
    ) -> ModelRunnerOutput:
        """Run one step and return what each scheduled request sampled. `grammar_bitmask`
        [len(scheduled), W] int32: the tokens each row may sample (structured outputs), or None."""
        return self.runner.execute(scheduled, grammar_bitmask)

    def execute_async(
        self,
        scheduled: list[ScheduledRequest],
        grammar_bitmask: np.ndarray | None = None,
        kv_connector_metadata: KVConnectorMetadata | None = None,
    ) -> StepFuture:
        """Dispatch one step; its outputs come from the future's `result()` (async scheduling).
        `kv_connector_metadata`: the KV connector's transfers before the step (core/kv_connector.py)."""
        return self.runner.execute_async(scheduled, grammar_bitmask, kv_connector_metadata)

    # -- the research stack: new weights, device memory handed back (worker/weight_update.py, sleep_mode.py)

    def update_weights(self, weights) -> list[str]:
        return weight_update.update_weights(self.runner, weights)

    def update_weights_from_path(self, path: str) -> list[str]:
        return weight_update.update_weights_from_path(self.runner, path)

    def sleep(self, level: int) -> sleep_mode.MemoryReport:
        return sleep_mode.sleep(self.runner, level)

    def wake_up(self) -> sleep_mode.MemoryReport:
        return sleep_mode.wake_up(self.runner)

    # -- a user's code on the model (LLM.apply_model, collective_rpc) ---------------------------------

    def apply_model(self, func) -> list:
        """`func` of each module the runner holds (one; a pipeline's stages: one each)."""
        return [func(model) for model in self.runner.models()]

    def collective_rpc(self, method, args: tuple, kwargs: dict):
        """The runner's `method` (a name), or `method(runner, ...)` (a callable), with args and kwargs."""
        if isinstance(method, str):
            return getattr(self.runner, method)(*args, **kwargs)
        return method(self.runner, *args, **kwargs)

    # -- the profiler: a jax.profiler trace of this process (CompilationConfig.profiler_dir) ----------

    def start_profile(self, folder: str) -> None:
        jax.profiler.start_trace(folder, create_perfetto_trace=True)

    def stop_profile(self) -> None:
        jax.profiler.stop_trace()

    def keep_kv_blocks(self, plan: KVConnectorMetadata) -> None:
        """A KV connector's copies at shutdown (a persistent disk tier's: core/kv_offload.py)."""
        self.runner.kv_connector.keep_blocks(self.runner.moved_kv_cache, plan)

    def shutdown(self) -> None:
        """Release what the runner holds outside the device (a KV connector's sockets)."""
        self.runner.kv_connector.close()
