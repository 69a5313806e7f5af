"""PipelineRunner: the model runner of a pipelined engine on one host (pipeline_parallel_size > 1).

The layers split into contiguous stages (worker/pipeline_stage.py), each placed on its own group of
tensor_parallel_size devices (a sub-mesh: tensor parallelism works within a stage as it does in one
ModelRunner) with only its layers' weights and KV cache. Each stage is one jitted program over its
devices (MPMD, as vLLM runs one worker per stage; not one SPMD program over a `pp` mesh axis, whose
stages would wait on each other's collectives): stage 0 embeds, every stage runs its layers, the last
also applies the final norm and gathers the sampled rows. The hidden states go from one stage's
devices to the next with `jax.device_put`, a device-to-device copy that JAX dispatches
asynchronously like the programs themselves, so the host returns from a step's dispatch before the
first stage has finished. The last stage's devices then run the sampler, unchanged.

Everything else is the ModelRunner's: the host batch, the buckets, warm-up, the compile guard, the
sampler and prompt-logprob programs (on the last stage), async scheduling's `last_sampled` (copied to
stage 0's devices for a step that reads it), the step hooks' model inputs, which a hook that
`runs_on_stages` gives each stage for its own layers (LoRA: the adapter slots of the stage's layers, on
its devices, worker/lora_manager.py). Each stage computes what the single-device forward
computes for its layers, in the same order, so a pipeline's tokens and logprobs are bitwise those of
one device.

Across processes (nnodes > 1, jax.distributed): the stages are cut from the global device list, each
inside one process, and a process loads, compiles and runs only its own stages; every process runs the
same step (executor/multihost.py sends it). The hand-over to a stage on another process is the same
`jax.device_put`, to that stage's devices: JAX's cross-host transfer (sharding/distributed.py turns it
on), in which the sending process puts its array and the receiving one a stand-in of the same shape
with no local data. Only the process of the last stage samples; it sends the outputs to process 0.
What host work process 0 does for another process's stages reaches that process before the step (a
LoRA adapter written into a slot, a research-stack call: executor/follower_calls.py `Call`); a
vision-language model's image rows for another process's stage go with the hidden states
(worker/mm_encoder.py `send_rows`). Another process's stage has no model, weights, slots or cache here.
"""

from __future__ import annotations

import dataclasses
import logging
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from xlaserve.config import EngineConfig
from xlaserve.kernels import KVCache
from xlaserve.kernels.dot_rows import traced_probing
from xlaserve.kernels.invariant import traced_with
from xlaserve.models.registry import get_model_class, model_config_from_hf
from xlaserve.sharding import Placement, make_mesh
from xlaserve.worker.input_batch import StepBatch, StepInputs
from xlaserve.worker.kv_cache import allocate_kv_cache
from xlaserve.worker.lora_manager import SlotHolder
from xlaserve.worker.model_loader import LoadedModel, load_model
from xlaserve.worker.model_runner import ModelRunner
from xlaserve.worker.pipeline_stage import StageLayout, split_layers, stage_devices
from xlaserve.worker.program import Program
from xlaserve.worker.state_copies import StageStateCopier
from xlaserve.worker.weight_update import ParamSet

logger = logging.getLogger(__name__)


def _stage_forward(
    graphdef,
    stage: StageLayout,
    params,
    kv_cache,
    x,
    prev_ids,
    prev_rows,
    positions,
    logits_indices,
    md,
    model_inputs,
):
    """One stage of the forward. Stage 0 takes the token ids (x [T]; where prev_rows >= 0 the id is the
    previous step's, read from prev_ids [S]) and embeds them; the others take the hidden states x
    [T, D]. A middle stage returns (x, kv_cache); the last (hidden [T, D], hidden of each sequence's
    sampled position [R, D], kv_cache), as ModelRunner's forward does. `model_inputs`: the hooks' keyword
    arguments of `run_layers` for this stage's layers (LoRA's `lora=`: its layers' slots; a
    vision-language model's `mm=`: the step's images, worker/mm_encoder.py)."""
    model = nnx.merge(graphdef, params)
    if stage.is_first:
        x = model.embed(jnp.where(prev_rows >= 0, prev_ids[jnp.maximum(prev_rows, 0)], x))
        if model_inputs.get("mm") is not None:  # a vision-language model's images, where their tokens are
            x = model_inputs["mm"].merge(x)
    x, kv_cache = model.run_layers(x, positions, kv_cache, md, layers=stage.layers, **model_inputs)
    if not stage.is_last:
        return x, kv_cache
    hidden = model.norm(x)
    return hidden, hidden[logits_indices], kv_cache


def _largest_stage_spec(kv_spec, model_config, layouts: list[StageLayout]):
    """The cache spec that sizes the budget, in every process alike (each stage's cache has the same
    blocks and state slots, so they must fit the stage holding the most): `kv_spec` (a stage's) with
    the most layers any stage holds, of each kind for a hybrid model (the ids of those stages: the
    host's groups only count them)."""
    if kv_spec.layer_kind != "hybrid":
        return dataclasses.replace(kv_spec, num_layers=max(len(layout.layers) for layout in layouts))
    whole = get_model_class(model_config.architecture).kv_cache_spec(model_config)
    stages = [whole.for_layers(layout.layers) for layout in layouts]
    return dataclasses.replace(
        kv_spec,
        attention_layers=max((spec.attention_layers for spec in stages), key=len),
        state_layers=max((spec.state_layers for spec in stages), key=len),
    )


@dataclasses.dataclass
class PipelineStage:
    """One stage: its layers, its devices, its model on them, and its program (model and program None
    for a stage of another process)."""

    layout: StageLayout
    placement: Placement  # its devices (this process's, or another's: a stage's inputs are sent there)
    model: LoadedModel | None
    forward: Program | None

    @property
    def is_local(self) -> bool:
        return self.model is not None

    @property
    def replicated(self) -> NamedSharding:
        """The stage's input, whole on each of its devices."""
        return self.placement.replicated


class PipelineRunner(ModelRunner):
    """A ModelRunner whose forward runs stage by stage; `kv_cache` is the list of the stages' caches, and
    `drafter` is None (a drafter's hook does not run on stages: `__init__` refuses it)."""

    def _load_model(self, config: EngineConfig, hf_config: dict, tensors, devices) -> LoadedModel:
        """Load every stage on its devices; the runner's own model is the last stage's (its head is the
        sampler's), with the weights of all stages counted and the KV spec of the stage with the most
        layers, so the blocks the budget gives each stage fit every stage."""
        parallel = config.parallel
        num_stages = parallel.pipeline_parallel_size
        devices = list(jax.devices() if devices is None else devices)
        groups = stage_devices(devices, parallel.tensor_parallel_size, num_stages)
        model_config = model_config_from_hf(hf_config)
        model_class = get_model_class(model_config.architecture)
        encoder_modules = model_class.encoder_modules
        layouts = split_layers(
            model_config.num_layers, num_stages, encoder_modules, config.model.text_only_mode
        )
        invariant = partial(
            traced_with, config.model.batch_invariant, float32=config.model.batch_invariant_float32
        )
        self.stages = []
        for layout, group in zip(layouts, groups):
            if group[0].process_index != jax.process_index():
                mesh = make_mesh(parallel.tensor_parallel_size, group)
                stacked = tuple(model_class.layer_stacks(model_config))
                placement = Placement(mesh, model_config, parallel.enable_expert_parallel, stacked)
                self.stages.append(PipelineStage(layout, placement, None, None))
                continue
            model = load_model(config, hf_config, tensors, group, stage=layout)
            fn = jax.jit(
                # A stage on one device: its few-row dots take their shapes' probed rows (dot_rows.py).
                invariant(traced_probing(len(group) == 1, partial(_stage_forward, model.graphdef, layout))),
                donate_argnames=("kv_cache",),
                compiler_options=config.compilation.compiler_options(),
            )
            forward = Program(f"pp_stage{layout.index}", fn, 2)
            self.stages.append(PipelineStage(layout, model.placement, model, forward))
            logger.info(
                "pipeline stage %d: layers %d-%d on devices %s",
                layout.index,
                layout.layers.start,
                layout.layers.stop - 1,
                [d.id for d in group],
            )
        local = [s for s in self.stages if s.is_local]  # at least one (stage_devices checks)
        return dataclasses.replace(
            local[-1].model,
            kv_spec=_largest_stage_spec(local[-1].model.kv_spec, model_config, layouts),
            weight_bytes=sum(s.model.weight_bytes for s in local),
        )

    def __init__(self, *args, **kwargs):
        self._no_prev_ids: jax.Array | None = None  # stage 0's stand-in for last_sampled (_prev_ids)
        super().__init__(*args, **kwargs)
        # A hook whose model inputs are not cut per stage (a draft model's) would be skipped silently, so
        # it is refused here by name. LoRA's run: each stage gets its own layers' adapter slots
        # (`_lora_slot_holders`); a vision-language model's, its images where its layers read them
        # (worker/mm_encoder.py: the encoder on the first stage).
        unstaged = [hook.name for hook in self.hooks if not hook.runs_on_stages]
        if unstaged:
            names = ", ".join(unstaged)
            raise ValueError(f"pipeline_parallel_size > 1 does not run the step hooks {names} yet")
        # N-gram speculation runs on stages for attention models; state layers' draft backups on stages
        # are not (the stages copy prefix-cache snapshots only).
        if self.num_spec_tokens and self.kv_spec.layer_kind != "full_attention":
            raise ValueError(
                "pipeline_parallel_size > 1 cannot be combined with speculative_config for a model with "
                f"{self.kv_spec.layer_kind!r} layers yet"
            )
        # What warm-up compiles as "the forward", through the engine's program store, is the last
        # stage's; the stages before it are compiled by `warm_up` here. (None: the last stage and the
        # sampler are another process's.)
        self._forward_fn = self.stages[-1].forward
        if self.state_copier is not None:  # a hybrid model's state copies: on each stage, its own rows
            specs = [self._stage_kv_spec(s) if s.is_local else None for s in self.stages]
            self.state_copier = StageStateCopier(specs, self.max_num_seqs)
        self._last_stage_inputs: dict[int, jax.ShapeDtypeStruct] = {}  # per token bucket, by warm_up

    def _lora_slot_holders(self, model: LoadedModel) -> list[SlotHolder | None]:
        """A set of LoRA slots per stage: its layers', on its devices (None: another process's stage,
        whose process writes the same adapters into the same slots, executor/multihost.py)."""
        return [
            SlotHolder(s.model.params, s.model.placement, s.layout) if s.is_local else None
            for s in self.stages
        ]

    @property
    def stage_placements(self) -> list[tuple[range, Placement]]:
        """Each stage's layers and devices (across processes some are another process's: a
        vision-language model's encoder runs where the first stage is, worker/mm_encoder.py)."""
        return [(s.layout.layers, s.placement) for s in self.stages]

    @property
    def encoder_model(self) -> tuple:
        """The first stage's graphdef and weights: it holds the embedding, and encodes the images (on the
        first stage's process only)."""
        first = self.stages[0].model
        return first.graphdef, first.params

    def _stage_kv_spec(self, stage: PipelineStage):
        """A stage's cache spec, with the runner's state slots (a hybrid model's: the budget may have
        fitted fewer snapshot slots, worker/kv_cache.py; a state slot has the same id on every stage)."""
        spec = stage.model.kv_spec
        if not hasattr(spec, "num_state_slots"):
            return spec
        return dataclasses.replace(
            spec,
            num_state_slots=self.kv_spec.num_state_slots,
            num_state_snapshots=self.kv_spec.num_state_snapshots,
        )

    def kv_bytes_per_block(self) -> int:
        """A block as the KV connector moves it: every local stage's layers (the connectors run on one
        host, so that is the whole model's, as an engine without stages moves it)."""
        return sum(
            self._moved_bytes_per_block(self._stage_kv_spec(s), self.kv_layout)
            for s in self.stages
            if s.is_local
        )

    def _connector_stages(self) -> list[bool]:
        """The connectors on stages, all given the step's one plan (block ids and host slots are the same
        on every stage, as the block tables are shared): host offload a worker half per stage over its own
        cache (its layers' blocks, on its devices; each stage's tier holds the same number of blocks, of
        its layers, sized by `kv_bytes_per_block`: the whole block's bytes; a persistent disk tier's files
        named apart per stage), disaggregated prefill one over every stage's cache, which serves and loads
        a block as the whole model's layers (worker/kv_transfer.py)."""
        return [s.is_local for s in self.stages]

    def allocate_kv_cache(self) -> list[KVCache | None]:
        """Each stage's zeroed cache of num_blocks, on its devices, holding its layers only (None for
        another process's stage)."""
        return [
            allocate_kv_cache(
                self._stage_kv_spec(s),
                self.num_blocks,
                self.block_size,
                self.backend.cache_dtype(self.dtype),
                s.model.placement,
            )
            if s.is_local
            else None
            for s in self.stages
        ]

    def param_sets(self) -> list[ParamSet]:
        """Each stage's weights (its layers; placeholders for the modules it does not run), in order:
        the research stack routes a weight to the stages holding it (worker/weight_update.py). Another
        process's stage is a set without params: its process updates and frees it."""
        return [
            ParamSet(s.model.params, s.model.head_dv, s.layout)
            if s.is_local
            else ParamSet(None, None, s.layout)
            for s in self.stages
        ]

    def models(self) -> list[nnx.Module]:
        """Each stage's module this process holds, in order (the layers it does not run are empty
        placeholders)."""
        return [nnx.merge(s.model.graphdef, s.model.params) for s in self.stages if s.is_local]

    def set_param_sets(self, sets: list[ParamSet]) -> None:
        """Each of this process's stages' new weights (`param_sets`' shapes, dtypes and shardings: nothing
        recompiles); the runner's own are its last stage's (where the last stage is, the sampler's head)."""
        for stage, weights in zip(self.stages, sets, strict=True):
            if stage.is_local:
                stage.model = dataclasses.replace(stage.model, params=weights.params, head_dv=weights.head_dv)
        own = [weights for weights in sets if weights.is_local][-1]
        self.set_params(own.params, own.head_dv)

    def _stage_args(self, index: int, kv_cache: list, x, batch: StepBatch, hook_arrays: dict) -> tuple:
        stage = self.stages[index]
        prev = (None, None)
        if stage.layout.is_first:
            prev = (self._prev_ids(stage, batch), batch.prev_rows)
        return (
            stage.model.params,
            kv_cache[index],
            x,
            *prev,
            batch.positions,
            batch.logits_indices,
            batch.md,
            self._model_inputs(hook_arrays, index, stage.model.placement),
        )

    def _prev_ids(self, stage: PipelineStage, batch: StepBatch) -> jax.Array:
        """The previous step's sampled ids [max_num_seqs], copied from the last stage's devices to stage
        0's. A batch that reads none of them (no placeholder: synchronous steps, micro-batches) gets a
        zeroed stand-in already there instead, so its stage 0 does not wait for the previous step's
        sampler: the stages of consecutive steps can then overlap."""
        placement = stage.model.placement
        if isinstance(batch.prev_rows, np.ndarray) and not (batch.prev_rows >= 0).any():
            if self._no_prev_ids is None:
                self._no_prev_ids = placement.zeros((self.max_num_seqs,), np.int32, placement.replicated)
            return self._no_prev_ids
        return jax.device_put(self.last_sampled, placement.replicated)

    def _hidden_struct(self, index: int, num_tokens: int) -> jax.ShapeDtypeStruct:
        """Stage `index`'s input as it arrives from the stage before (copied to its devices, whole): the
        hidden states [T, D] in the compute dtype, known without the stage before (another process's)."""
        shape = (num_tokens, self.model_config.hidden_size)
        return jax.ShapeDtypeStruct(shape, self.dtype, sharding=self.stages[index].replicated)

    def _forward_args(self, kv_cache, batch: StepBatch, hook_arrays: dict) -> tuple:
        """The last stage's arguments, for warm-up (a shape struct stands for the hidden states)."""
        num_tokens = batch.input_ids.shape[0]
        if num_tokens not in self._last_stage_inputs:
            raise RuntimeError(f"the last stage's input for bucket {num_tokens} is known after warm_up only")
        x = self._last_stage_inputs[num_tokens]
        return self._stage_args(len(self.stages) - 1, kv_cache, x, batch, hook_arrays)

    def warm_up(self) -> None:
        """Compile this process's stages but the last for each token bucket, then the ModelRunner's
        warm-up: the last stage and the samplers (where the last stage is this process's). Nothing
        crosses processes meanwhile: a stage's inputs from another process are shape structs."""
        if self.mm_encoder is not None:
            self.mm_encoder.is_warming_up = True
        try:
            self._warm_up_stages()
        finally:
            if self.mm_encoder is not None:
                self.mm_encoder.is_warming_up = False

    def _warm_up_stages(self) -> None:
        for num_tokens in self.token_buckets:
            batch = self._build_batch([], num_tokens)
            hook_arrays = self._prepare_hooks([], num_tokens, set())
            x = batch.input_ids
            for index, stage in enumerate(self.stages[:-1]):
                hidden = self._hidden_struct(index + 1, num_tokens)
                if stage.is_local:
                    args = self._stage_args(index, self.kv_cache, x, batch, hook_arrays)
                    compiled = stage.forward.lower(*args).compile()
                    stage.forward.add(args, {}, compiled)
                    # What another process's next stage expects is this struct, not the program's output.
                    out = compiled.out_info[0]
                    if (out.shape, out.dtype) != (hidden.shape, hidden.dtype):
                        raise RuntimeError(f"stage {index} returns {out}, not the hidden states {hidden}")
                x = hidden
            self._last_stage_inputs[num_tokens] = x
        if self.stages[-1].is_local:
            super().warm_up()
            return
        # The hooks' own programs (LoRA's slot writes into this process's stages), as compile_all runs them.
        batches = {n: self._build_batch([], n) for n in self.token_buckets}
        for hook in self.hooks:
            hook.warm_up(batches, self._num_seqs_for)
        if self.state_copier is not None:
            self.kv_cache = self.state_copier.warm_up(self.kv_cache)
        self.guard.arm()

    def _run_forward(self, batch: StepBatch, hook_arrays: dict) -> tuple[jax.Array, jax.Array] | None:
        """Stage by stage, each on its own devices; the hidden states are copied to the next stage's.
        None where the last stage is another process's."""
        x = batch.input_ids
        for index, stage in enumerate(self.stages):
            if index:
                x = self._hand_on(x, index, batch.input_ids.shape[0])
            if not stage.is_local:
                x = None
                if self.mm_encoder is not None:  # its image rows, from our first stage (if it reads them)
                    self.mm_encoder.send_rows(hook_arrays[self.mm_encoder.name], index)
                continue
            out = stage.forward(*self._stage_args(index, self.kv_cache, x, batch, hook_arrays))
            x, self.kv_cache[index] = out[0], out[-1]
        return (out[0], out[1]) if self.stages[-1].is_local else None

    def _hand_on(self, x: jax.Array | None, index: int, num_tokens: int) -> jax.Array | None:
        """The hidden states `x` of stage index - 1 (None: another process's) onto stage `index`'s
        devices. Between processes both call `jax.device_put`: the sender with its array, the receiver
        with a stand-in on the sender's devices (no local data), as JAX's cross-host transfer wants."""
        stage, before = self.stages[index], self.stages[index - 1]
        if x is None:
            if not stage.is_local:
                return None  # neither end is this process's
            struct = self._hidden_struct(index, num_tokens)
            x = jax.make_array_from_single_device_arrays(
                struct.shape, before.replicated, [], dtype=struct.dtype
            )
        return jax.device_put(x, stage.replicated)

    def dispatch(self, inputs: StepInputs) -> tuple[dict[str, jax.Array], object]:
        """A step; where the last stage is another process's, only this process's stages run (the
        hidden states handed on) and nothing is sampled here: no outputs."""
        if self.stages[-1].is_local:
            return super().dispatch(inputs)
        self.guard.begin()
        step = self.timing.on_dispatch()
        copies = inputs.state_copies  # a hybrid model's, as ModelRunner.dispatch runs them
        if copies is not None:
            self.kv_cache = self.state_copier.apply(self.kv_cache, copies[0])
        self._run_forward(self.placement.step_inputs(inputs.batch), inputs.hooks)
        if copies is not None:
            self.kv_cache = self.state_copier.apply(self.kv_cache, copies[1])
        self.guard.check(f"a step in bucket {inputs.batch.input_ids.shape[0]}")
        return {}, step
