"""ModelRunner: the flat ragged batch, padded to buckets, through a few jitted functions.

Per step the host builds small numpy arrays (ids, positions, slot mapping, block tables, sampling
tensors), pads them to a token bucket, and dispatches two jitted calls back to back: the model
forward (KV cache donated, updated in place) and the sampler (LM head on one row per sequence,
then sampling). Only the sampled ids come back to the host.

Async scheduling: `execute_async` returns a `StepFuture` right after the dispatch. The runner keeps
the last step's sampled ids on the device (`last_sampled`, padded to max_num_seqs so that every
bucket reads one shape), and the forward substitutes them where the next batch's `prev_rows` point:
a token sampled in step N feeds step N+1 without a round trip through the host.

Features (LoRA, a draft model) reach the step through hooks (worker/step_hooks.py), and K/V held outside
the device cache (host offload) through the KV connector (core/kv_connector.py), which copies blocks out
and in before the forward (set up by worker/kv_plumbing.py, with the cache's layout): the step below is
the same code whether they are on or off. Every step is built for k verified drafts per request (k = 0
without speculative decoding), so a step verifies when some request carries drafts and samples otherwise.
The host half of a step, the requests as arrays, is worker/step_prepare.py's; this module dispatches them.
"""

from __future__ import annotations

import logging
import math
import time

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from xlaserve.config import EngineConfig
from xlaserve.core.encoder_cache_manager import EncoderCacheLayout
from xlaserve.core.kv_connector import KVConnectorMetadata
from xlaserve.core.outputs import ModelRunnerOutput
from xlaserve.kernels import KVCache
from xlaserve.models.registry import get_model_class
from xlaserve.sharding import Placement
from xlaserve.worker.buckets import make_token_buckets
from xlaserve.worker.compile_guard import CompileGuard
from xlaserve.worker.draft_model import DraftModel
from xlaserve.worker.eagle3 import Eagle3Drafter
from xlaserve.worker.input_batch import StepBatch, StepInputs
from xlaserve.worker.kv_cache import allocate_kv_cache, num_kv_blocks
from xlaserve.worker.kv_cache_groups import num_state_copy_slots
from xlaserve.worker.kv_plumbing import KVPlumbing
from xlaserve.worker.lora_manager import LoRAManager, SlotHolder
from xlaserve.worker.mm_encoder import make_mm_hook
from xlaserve.worker.model_loader import LoadedModel, load_model
from xlaserve.worker.mtp import MTPDrafter
from xlaserve.worker.pooler import Pooler, PoolingHook
from xlaserve.worker.sampler import SamplerOutput
from xlaserve.worker.spec_decode import VerifyOutput
from xlaserve.worker.state_copies import StateCopier
from xlaserve.worker.step_future import StepFuture, StepTiming
from xlaserve.worker.step_hooks import DraftModelHook, LoRAHook, StepHook
from xlaserve.worker.step_output import make_output, to_host
from xlaserve.worker.step_prepare import StepPreparation
from xlaserve.worker.step_programs import make_step_programs
from xlaserve.worker.warm_up import compile_all
from xlaserve.worker.weight_update import ParamSet

logger = logging.getLogger(__name__)


class ModelRunner(StepPreparation, KVPlumbing):
    def __init__(
        self,
        config: EngineConfig,
        hf_config: dict,
        tensors: dict[str, np.ndarray],
        max_model_len: int,
        devices=None,
        pooler: Pooler | None = None,
    ):
        """`pooler`: a pooling runner's (worker/pooler.py; None: a generate runner)."""
        self.config = config
        self.hf_config = hf_config  # keys the stored executables (worker/program_store.py)
        model = self._load_model(config, hf_config, tensors, devices)
        self.model_config = model.model_config
        # The logits' width (>= model_config.vocab_size): the [R, V] sampling tensors match it.
        self.padded_vocab_size = model.padded_vocab_size
        self.dtype = model.dtype
        self.mesh, self.placement = model.mesh, model.placement
        self.kv_spec, self.backend = model.kv_spec, model.backend
        self.kv_heads = model.kv_heads  # the checkpoint's, which the cache may hold copies of
        self.graphdef, self.params = model.graphdef, model.params
        self.weight_bytes = model.weight_bytes  # the model's own (what sleep level 2 frees)
        self.stage = model.stage  # the modules holding weights (text-only mode: no encoder's)
        self.head_params = (model.params, model.head_dv)  # what computing logits reads
        # The weights on the host while asleep at level 2 (worker/sleep_mode.py), a drafter's too.
        self.slept_weights = self.slept_drafter = None
        self.prepared_update = None  # new weights checked, not yet installed (across processes: every one's)
        # Adapter slots on the device (worker/lora_manager.py), or None: LoRA off, no hook, no cost.
        self.lora = (
            LoRAManager(
                config.lora,
                get_model_class(self.model_config.architecture),
                self.model_config,
                self.dtype,
                self._lora_slot_holders(model),
            )
            if config.lora.enable_lora
            else None
        )
        self.max_model_len = max_model_len
        self.block_size = config.cache.block_size
        # Decode context parallel: each rank of a group stores block_size / dcp of a block's tokens
        # (sharding/context_parallel.py), so the device cache's blocks are that long.
        self.dcp = config.parallel.decode_context_parallel_size
        self.cache_block_size = self.block_size // self.dcp
        # The cache's spec, its host groups and slots (worker/kv_plumbing.py).
        self._lay_out_kv_cache(max_model_len)
        # The step's device functions as Programs (worker/step_programs.py), jitted with the graphdef bound.
        vocab = self.model_config.vocab_size
        # Prefill context parallel: a step's tokens split over the mesh's "context" axis.
        self.pcp = config.parallel.prefill_context_parallel_size
        programs = make_step_programs(
            self.graphdef,
            vocab,
            config.scheduler.max_num_seqs,
            config.model.batch_invariant,
            config.compilation.compiler_options(),
            token_sharding=NamedSharding(self.mesh, PartitionSpec("context")) if self.pcp > 1 else None,
            # On one device the dots' traced shapes are the ones that run: their rows can be probed.
            probe_dot_rows=self.mesh.size == 1,
            float32_invariant=config.model.batch_invariant_float32,
            logprobs_mode=config.model.logprobs_mode,
            max_logprobs=config.model.max_logprobs_of(vocab),
        )
        self._forward_fn, self._sample_fn = programs.forward, programs.sample
        self._prompt_logprobs_fn, self._verify_fn = programs.prompt_logprobs, programs.verify
        spec = config.speculative
        self.num_spec_tokens = config.num_spec_tokens
        self.num_programs_loaded = self.num_programs_compiled = 0  # by warm-up, from disk or compiled

        # A vision-language model's images: encoded into a device cache, merged at their placeholders
        # (built first: an MTP drafter reads an M-RoPE model's positions from it).
        self.mm_encoder = make_mm_hook(self)
        # Speculative decoding's draft model (worker/draft_model.py): its cache shares the block ids.
        self.drafter = None
        if spec is not None and spec.method == "draft_model":
            self.drafter = DraftModel(config, vocab, self.padded_vocab_size, devices)
        elif spec is not None and spec.method == "mtp":  # the checkpoint's own layer (worker/mtp.py)
            self.drafter = MTPDrafter(config, self, hf_config, tensors, vocab)
        elif spec is not None and spec.method == "eagle3":  # over the target's hidden states
            self.drafter = Eagle3Drafter(config, self, vocab)
        # runner="pooling": the prompt's hidden states pooled on the host, beside the (unread) sampler.
        self.pooler = pooler
        # The features' hooks into the step (worker/step_hooks.py), in the order they run.
        self.hooks: list[StepHook] = [
            *([LoRAHook(self.lora)] if self.lora is not None else []),
            *([DraftModelHook(self.drafter)] if self.drafter is not None else []),
            *([PoolingHook(self.pooler)] if self.pooler is not None else []),
        ]
        if self.mm_encoder is not None:  # last: its arrays are the forward's
            self.hooks.append(self.mm_encoder)
        # A draft model writes K/V for k positions past each step's tokens (slots the scheduler adds).
        self.num_lookahead_tokens = self.num_spec_tokens if self.drafter is not None else 0
        self.num_blocks = num_kv_blocks(
            config.cache,
            self.kv_spec,
            self.backend.cache_dtype(self.dtype),
            extra_bytes_per_block=0 if self.drafter is None else self.drafter.bytes_per_block(),
            cache_block_size=self.cache_block_size,
        )
        self.kv_cache = self.allocate_kv_cache()
        # A state model's copies of state slots around the forward: prefix-cache snapshots, drafts'
        # backups (None: no state layers, or neither prefix caching nor speculative decoding).
        self.state_copier = (
            StateCopier(self.kv_spec, config.scheduler.max_num_seqs)
            if hasattr(self.kv_spec, "copy_state_slots") and num_state_copy_slots(config)
            else None
        )
        # Copies between the cache and K/V held elsewhere, around each step (worker/kv_plumbing.py).
        self._set_up_kv_connector(self.kv_heads)
        sched = config.scheduler
        if self.drafter is not None:
            self.drafter.allocate(self.num_blocks, sched.max_num_seqs, self.padded_vocab_size)
        # A lone request verifying k drafts runs 1 + k tokens: its own bucket, not the next power of two,
        # of one sequence row (worker/buckets.py): a forward, and the lone request's sampler and verifier.
        extra_buckets = (1 + self.num_spec_tokens,) if self.num_spec_tokens else ()
        sizes = config.compilation.cudagraph_capture_sizes
        base_buckets = make_token_buckets(sched.max_num_batched_tokens, sizes=sizes)
        self.token_buckets = make_token_buckets(sched.max_num_batched_tokens, extra_buckets, sizes)
        if self.pcp > 1:  # every bucket splits evenly over the context ranks
            base_buckets = sorted({-(-n // self.pcp) * self.pcp for n in base_buckets})
            self.token_buckets = sorted({-(-n // self.pcp) * self.pcp for n in self.token_buckets})
        self.lone_buckets = tuple(sorted(set(self.token_buckets) - set(base_buckets)))
        self.max_num_seqs = sched.max_num_seqs
        self.max_blocks_per_seq = math.ceil(max_model_len / self.block_size)
        self.guard = CompileGuard(strict=config.compilation.strict_compile_guard)
        # Host-idle and device-idle time per step (num_steps, device_wait_s: the host blocked on results).
        self.timing = StepTiming()
        # The last step's sampled ids [max_num_seqs], which the next step may read on the device. Made
        # like the sampler's output (committed, replicated), so the forward that warm-up compiles with it
        # is the one every later step calls with the sampler's ids (a host array would key apart).
        self.last_sampled = self.placement.zeros((self.max_num_seqs,), np.int32, self.placement.replicated)

    def _load_model(self, config: EngineConfig, hf_config: dict, tensors, devices) -> LoadedModel:
        """The model on `devices` (a pipelined runner loads one stage per device group instead:
        worker/pipeline_runner.py)."""
        return load_model(config, hf_config, tensors, devices)

    def _lora_slot_holders(self, model: LoadedModel) -> list[SlotHolder]:
        """Where the LoRA slots live: beside the model's weights (a pipeline's: one set per stage)."""
        return [SlotHolder(model.params, model.placement)]

    @property
    def loaded_weight_bytes(self) -> int:
        """Bytes of every weight the engine loaded on the devices, a drafter's too, as vLLM counts them
        (the /metrics gauge xlaserve:model_weight_bytes)."""
        return self.weight_bytes + (0 if self.drafter is None else self.drafter.weight_bytes)

    @property
    def num_steps(self) -> int:
        return self.timing.num_steps

    @property
    def device_wait_s(self) -> float:
        """Seconds the host spent blocked on steps' results: the host's idle time."""
        return self.timing.host_wait_s

    def set_max_model_len(self, max_model_len: int) -> None:
        """Serve a shorter context than the runner was built for (the KV cache cannot hold more);
        before warm-up only, since the block tables' width is part of every compiled shape."""
        if self.guard.is_armed:
            raise RuntimeError("set_max_model_len must be called before warm_up")
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = math.ceil(max_model_len / self.block_size)

    def allocate_kv_cache(self) -> KVCache:
        """The zeroed cache of num_blocks (at start, and again on waking from sleep)."""
        return allocate_kv_cache(
            self.kv_spec,
            self.num_blocks,
            self.cache_block_size,
            self.backend.cache_dtype(self.dtype),
            self.placement,
        )

    def set_params(self, params, head_dv) -> None:
        """New weights of the same shapes, dtypes and shardings (worker/weight_update.py): every
        program takes them as arguments, so nothing recompiles."""
        self.params = params
        self.head_params = (params, head_dv)
        if self.drafter is not None:
            self.drafter.follow_target(self.head_params)
        if self.mm_encoder is not None:  # images encoded by the old weights are encoded again
            self.mm_encoder.slot_contents.clear()

    def param_sets(self) -> list[ParamSet]:
        """The weights as the research stack updates and frees them: the whole model, one set (a
        pipeline's runner: one per stage)."""
        return [ParamSet(self.params, self.head_params[1], self.stage)]

    def models(self) -> list[nnx.Module]:
        """The model as the programs run it (LLM.apply_model): its weights in the engine's layouts and
        shardings, one module (a pipeline's runner: one per stage this process holds)."""
        return [nnx.merge(self.graphdef, self.params)]

    def set_param_sets(self, sets: list[ParamSet]) -> None:
        """`param_sets` replaced by new ones of the same shapes, dtypes and shardings."""
        (weights,) = sets
        self.set_params(weights.params, weights.head_dv)

    @property
    def encoder_cache_layout(self) -> EncoderCacheLayout | None:
        """The device encoder cache's slots (worker/mm_encoder.py); None: a text-only model."""
        return None if self.mm_encoder is None else self.mm_encoder.layout

    @property
    def stage_placements(self) -> list[tuple[range, Placement]]:
        """Each pipeline stage's decoder layers and devices, in order; here one stage of them all."""
        return [(range(self.model_config.num_layers), self.placement)]

    @property
    def encoder_model(self) -> tuple:
        """(graphdef, params) of the devices holding the embedding (a pipeline's first stage), where a
        vision-language model's images are encoded (worker/mm_encoder.py)."""
        return self.graphdef, self.params

    # -- compiling ------------------------------------------------------------------------------

    def warm_up(self) -> None:
        """Compile every token bucket and every sampler variant, then arm the compile guard
        (worker/warm_up.py)."""
        compile_all(self)
        self.moved_kv_cache = self.kv_connector.warm_up(self.moved_kv_cache)
        if self.state_copier is not None:
            self.kv_cache = self.state_copier.warm_up(self.kv_cache)
        self.guard.arm()

    def _verify_q(self, hook_arrays: dict) -> tuple | None:
        """The verifier's q argument: a proposer hook's (a draft model's), or None."""
        for hook in self.hooks:
            q = hook.verify_inputs(hook_arrays[hook.name])
            if q is not None:
                return q
        return None

    # -- one step -------------------------------------------------------------------------------

    def _model_inputs(self, hook_arrays: dict, stage: int = 0, placement=None) -> dict:
        """The hooks' keyword arguments of the model's forward, or of pipeline stage `stage`'s (its
        devices' `placement`; None: the runner's)."""
        ready = (placement or self.placement).step_inputs
        model_inputs = {}
        for hook in self.hooks:
            model_inputs |= hook.forward_inputs(ready(hook_arrays[hook.name]), stage)
        return model_inputs

    def _forward_args(self, kv_cache: KVCache, batch: StepBatch, hook_arrays: dict) -> tuple:
        model_inputs = self._model_inputs(hook_arrays)
        return (
            self.params,
            kv_cache,
            batch.input_ids,
            self.last_sampled,
            batch.prev_rows,
            batch.positions,
            batch.logits_indices,
            batch.md,
            model_inputs,
        )

    def forward(self, kv_cache: KVCache, batch: StepBatch, hook_arrays: dict | None = None) -> tuple:
        """The model over one batch (host or device arrays): (hidden [T, D], the hidden of each
        sequence's sampled position [R, D], the updated cache), and with an EAGLE-3 drafter the aux
        hidden states [T, 3 * D] it reads. `kv_cache` is donated: use only the one returned. Where
        `batch.prev_rows` >= 0 the id is read from `last_sampled`. `hook_arrays`: the hooks' host arrays
        of the step (None: those of a step of base-model tokens)."""
        if hook_arrays is None:
            hook_arrays = self._prepare_hooks([], batch.input_ids.shape[0], set())
        return self._forward_fn(*self._forward_args(kv_cache, batch, hook_arrays))

    def _run_forward(self, batch: StepBatch, hook_arrays: dict) -> tuple:
        """-> (hidden, hidden_rd), and the aux hidden states where a drafter asks for them."""
        hidden, hidden_rd, self.kv_cache, *aux = self.forward(self.kv_cache, batch, hook_arrays)
        return hidden, hidden_rd, *aux

    def run(self, inputs: StepInputs) -> dict[str, np.ndarray]:
        """The device half of a step, identical on every process: forward, sample, prompt logprobs."""
        return self.fetch(*self.dispatch(inputs))

    def dispatch(self, inputs: StepInputs) -> tuple[dict[str, jax.Array], object]:
        """Start a step on the device; returns its output arrays (not waited for) and its timing
        record. The sampled ids become `last_sampled`, which the next step may read."""
        ready = self.placement.step_inputs
        self.guard.begin()
        step = self.timing.on_dispatch()
        # Blocks evicted by this step's allocations are copied out before it overwrites them, then blocks
        # found outside the device are copied in before attention reads them.
        self.kv_connector.save_kv(self.moved_kv_cache, inputs.kv_connector_metadata)
        self.moved_kv_cache = self.kv_connector.load_kv(self.moved_kv_cache, inputs.kv_connector_metadata)
        batch = ready(inputs.batch)
        if inputs.state_copies is not None:  # a prefix hit's snapshot into its live slot
            self.kv_cache = self.state_copier.apply(self.kv_cache, inputs.state_copies[0])
        hidden, hidden_rd, *aux = self._run_forward(batch, inputs.hooks)
        if inputs.state_copies is not None:  # the state after a block boundary, into a snapshot
            self.kv_cache = self.state_copier.apply(self.kv_cache, inputs.state_copies[1])
        pooled = {}  # device outputs the hooks take from the hidden states (pooling)
        for hook in self.hooks:
            pooled |= hook.after_forward(hidden, hidden_rd, inputs.hooks[hook.name])
        if inputs.spec is None:  # no request carries drafts: sample one token per sequence
            out: SamplerOutput
            out, self.last_sampled = self._sample_fn(
                self.head_params, hidden_rd, ready(inputs.sampling), with_logprobs=inputs.with_logprobs
            )
            device = {"token_ids": out.token_ids}
            num_accepted = None
        else:  # synchronous (speculative decoding turns async scheduling off): last_sampled unused
            out: VerifyOutput = self._verify_fn(
                self.head_params,
                hidden_rd,
                ready(inputs.sampling),
                ready(inputs.spec),
                self._verify_q(inputs.hooks),
                with_logprobs=inputs.with_logprobs,
            )
            device = {"token_ids": out.token_ids, "num_accepted": out.num_accepted}
            num_accepted = out.num_accepted
        device |= pooled
        drafter_hidden = aux[0] if aux else hidden  # what the drafter reads (EAGLE-3: the aux states)
        for hook in self.hooks:  # e.g. the next step's drafts, from the tokens this one emitted
            device |= hook.after_sampling(
                batch, drafter_hidden, out.token_ids, num_accepted, inputs.sampling, inputs.hooks[hook.name]
            )
        # Blocks this step completed that leave the device (a producer's prompt blocks): after the
        # drafter's step, which writes its cache's rows of the step's tokens.
        self.kv_connector.save_kv_after_forward(self.moved_kv_cache, inputs.kv_connector_metadata)
        if inputs.with_logprobs:
            device |= {"lp_ids": out.logprob_token_ids, "lp_vals": out.logprobs, "lp_ranks": out.sampled_rank}
        if inputs.prompt_targets is not None:
            ids, vals, ranks = self._prompt_logprobs_fn(
                self.head_params, hidden, ready(inputs.prompt_targets)
            )
            device |= {"plp_ids": ids, "plp_vals": vals, "plp_ranks": ranks}
        self.guard.check(f"a step in bucket {inputs.batch.input_ids.shape[0]}")
        self.timing.on_dispatched(step, out.token_ids)
        return device, step

    def fetch(self, device: dict[str, jax.Array], step) -> dict[str, np.ndarray]:
        """Block on a dispatched step's outputs and bring them to the host."""
        t0 = time.perf_counter()
        host = {k: to_host(v) for k, v in device.items()}
        self.timing.on_read(step, time.perf_counter() - t0)
        return host

    def execute(
        self, scheduled, grammar_bitmask: np.ndarray | None = None, kv_connector_metadata=None
    ) -> ModelRunnerOutput:
        """Run one step for `scheduled` (a list of ScheduledRequest) in this process alone."""
        return self.execute_async(scheduled, grammar_bitmask, kv_connector_metadata).result()

    def execute_async(
        self,
        scheduled,
        grammar_bitmask: np.ndarray | None = None,
        kv_connector_metadata: KVConnectorMetadata | None = None,
    ) -> StepFuture:
        """Prepare and dispatch one step; its outputs are read when the future's `result()` is asked.
        Rows whose last id the previous step sampled read it from `last_sampled` on the device.
        (A step that schedules nothing has no KV transfers: the scheduler keeps them for the next.)"""
        if not scheduled:
            return StepFuture.done(ModelRunnerOutput())
        inputs = self.prepare(scheduled, grammar_bitmask, kv_connector_metadata)
        device, step = self.dispatch(inputs)

        def read() -> ModelRunnerOutput:
            output = make_output(scheduled, self.fetch(device, step), inputs.failed_req_ids, self.hooks)
            output.kv_connector_stats = self.kv_connector.take_stats()
            return output

        return StepFuture(read, inputs.failed_req_ids)

    def compiled_forward_text(self, num_tokens: int) -> str:
        """The optimized HLO of the forward for one token bucket (to inspect collectives)."""
        hook_arrays = self._prepare_hooks([], num_tokens, set())
        lowered = self._forward_fn.lower(
            *self._forward_args(self.kv_cache, self._build_batch([], num_tokens), hook_arrays)
        )
        return lowered.compile().as_text()
