"""ModelRunner: the flat ragged batch, padded to buckets, through a few jitted functions.

Per step the host builds small numpy arrays (ids, positions, slot mapping, block tables, sampling
tensors), pads them to a token bucket, and dispatches two jitted calls back to back: the model
forward (KV cache donated, updated in place) and the sampler (LM head on one row per sequence,
then sampling). Only the sampled ids come back to the host.

Async scheduling: `execute_async` returns a `StepFuture` right after the dispatch. The runner keeps
the last step's sampled ids on the device (`last_sampled`, padded to max_num_seqs so that every
bucket reads one shape), and the forward substitutes them where the next batch's `prev_rows` point:
a token sampled in step N feeds step N+1 without a round trip through the host.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.config import EngineConfig
from xlaserve.core.outputs import ModelRunnerOutput
from xlaserve.kernels import KVCache
from xlaserve.models.registry import get_model_class
from xlaserve.sharding.vocab import mask_padded_vocab
from xlaserve.worker.buckets import make_token_buckets, pick_bucket, request_bucket
from xlaserve.worker.compile_guard import CompileGuard
from xlaserve.worker.draft_model import DraftModel
from xlaserve.worker.input_batch import (
    StepBatch,
    StepInputs,
    build_step_batch,
    isolate_failures,
    sampling_tensors,
)
from xlaserve.worker.kv_cache import allocate_kv_cache, bytes_per_block, num_kv_blocks
from xlaserve.worker.lora_manager import LoRAManager
from xlaserve.worker.model_loader import load_model
from xlaserve.worker.program import Program
from xlaserve.worker.sampler import SamplerOutput, prompt_logprobs, sample
from xlaserve.worker.spec_decode import SpecInputs, VerifyOutput, build_spec_inputs, step_bitmask, verify
from xlaserve.worker.step_future import StepFuture, StepTiming
from xlaserve.worker.step_output import make_output, to_host
from xlaserve.worker.warm_up import compile_all

logger = logging.getLogger(__name__)

# The device functions of a step. The runner jits each once with its graphdef bound (a closure,
# not a static argument: hashing a model's graphdef costs ~0.3 ms on every call).


def _forward(
    graphdef, params, kv_cache, input_ids, prev_ids, prev_rows, positions, logits_indices, md, lora=None
):
    """-> (hidden [T, D], hidden of each sequence's sampled position [R, D], kv_cache).
    prev_ids [S]: the previous step's sampled ids, still on the device; prev_rows [T]: where >= 0, the
    row of prev_ids that is this token's id (async scheduling). `lora`: a LoRABatch (models/lora.py)
    with LoRA enabled; without it the program is the base model's."""
    input_ids = jnp.where(prev_rows >= 0, prev_ids[jnp.maximum(prev_rows, 0)], input_ids)
    model = nnx.merge(graphdef, params)
    lora_kwargs = {} if lora is None else {"lora": lora}
    hidden, kv_cache = model(input_ids, positions, kv_cache, md, **lora_kwargs)
    return hidden, hidden[logits_indices], kv_cache


def _logits(graphdef, vocab_size, head_params, hidden):
    """[N, D] -> [N, V_padded] float32, padding ids at -inf (sharding/vocab.py): never sampled, never
    in logprobs. `head_params`: (the model's params, the LM head as [D, V] or None)."""
    params, head_dv = head_params
    return mask_padded_vocab(nnx.merge(graphdef, params).compute_logits(hidden, head_dv), vocab_size)


def _sample(graphdef, vocab_size, num_ids, params, hidden_rd, st, *, with_logprobs):
    """-> (SamplerOutput, the sampled ids padded to [num_ids] for the next step's forward)."""
    num_seqs = st.temperature.shape[0]
    if hidden_rd.shape[0] != num_seqs:  # speculative decoding gathers K + 1 rows per sequence: the first
        hidden_rd = hidden_rd.reshape(num_seqs, -1, hidden_rd.shape[-1])[:, 0]
    logits = _logits(graphdef, vocab_size, params, hidden_rd)
    out = sample(logits, st, with_logprobs=with_logprobs)
    return out, jnp.pad(out.token_ids, (0, num_ids - out.token_ids.shape[0]))


def _verify(graphdef, vocab_size, params, hidden_rd, st, spec: SpecInputs, q_buf, rows, *, with_logprobs):
    """Speculative decoding: logits at each request's K + 1 verified positions (hidden_rd
    [R * (K + 1), D], gathered by the forward at spec.verify_indices), then rejection sampling.
    A draft model's q: q_buf [S, K, V] (worker/draft_model.py) at rows [R]."""
    logits = _logits(graphdef, vocab_size, params, hidden_rd)
    draft_probs = None if q_buf is None else q_buf[rows]
    return verify(logits, st, spec, with_logprobs=with_logprobs, draft_probs=draft_probs)


def _prompt_logprobs(graphdef, vocab_size, params, hidden, target_ids):
    return prompt_logprobs(_logits(graphdef, vocab_size, params, hidden), target_ids)


def _fill_prompt_targets(prompt_targets: np.ndarray, offset: int, s) -> None:
    req, start = s.request, s.num_computed_tokens
    stop = min(start + s.num_new_tokens, req.num_prompt_tokens - 1)
    if stop > start:  # positions whose next token is still a prompt token
        prompt_targets[offset : offset + stop - start] = req.prompt_token_ids[start + 1 : stop + 1]


def _with_verify_indices(batch: StepBatch, spec: SpecInputs) -> StepBatch:
    return dataclasses.replace(batch, logits_indices=spec.verify_indices.reshape(-1))


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        hf_config: dict,
        tensors: dict[str, np.ndarray],
        max_model_len: int,
        devices=None,
    ):
        self.config = config
        self.hf_config = hf_config  # keys the stored executables (worker/program_store.py)
        model = load_model(config, hf_config, tensors, devices)
        self.model_config = model.model_config
        # The logits' width (>= model_config.vocab_size): the [R, V] sampling tensors match it.
        self.padded_vocab_size = model.padded_vocab_size
        self.dtype = model.dtype
        self.mesh, self.placement = model.mesh, model.placement
        self.kv_spec, self.backend = model.kv_spec, model.backend
        self.graphdef, self.params = model.graphdef, model.params
        self.weight_bytes = model.weight_bytes  # the /metrics gauge xlaserve:model_weight_bytes
        self.head_params = (model.params, model.head_dv)  # what computing logits reads
        # Adapter slots on the device (worker/lora_manager.py), or None: LoRA off, no cost.
        self.lora = (
            LoRAManager(
                config.lora,
                get_model_class(self.model_config.architecture),
                self.model_config,
                model.params,
                self.dtype,
                self.placement,
            )
            if config.lora.enable_lora
            else None
        )
        self.max_model_len = max_model_len
        self.block_size = config.cache.block_size
        # Each a Program (worker/program.py): a step calls the executable warm-up loaded or compiled
        # for its shapes; the weights (and the KV cache) lead, outside the per-call signature.
        self._forward_fn = Program(
            "forward",
            jax.jit(partial(_forward, self.graphdef), donate_argnames=("kv_cache",)),
            num_fixed_args=2,
        )
        vocab = self.model_config.vocab_size
        # `with_logprobs` is traced (a runtime flag), not static: warm-up compiles 4 sampler programs
        # per request bucket (penalties x grammar), not 8 (sampler.py).
        self._sample_fn = Program(
            "sample", jax.jit(partial(_sample, self.graphdef, vocab, config.scheduler.max_num_seqs))
        )
        self._prompt_logprobs_fn = Program(
            "prompt_logprobs", jax.jit(partial(_prompt_logprobs, self.graphdef, vocab))
        )
        spec = config.speculative
        self.num_spec_tokens = config.num_spec_tokens
        self._verify_fn = Program(
            "verify",
            jax.jit(partial(_verify, self.graphdef, vocab), static_argnames=("with_logprobs",)),
            static_argnames=("with_logprobs",),
        )
        self.num_programs_loaded = self.num_programs_compiled = 0  # by warm-up, from disk or compiled

        # Speculative decoding's draft model (worker/draft_model.py): its cache shares the block ids.
        self.drafter = None
        if spec is not None and spec.method == "draft_model":
            self.drafter = DraftModel(config, vocab, self.padded_vocab_size, devices)
        # A draft model writes K/V for k positions past each step's tokens (slots the scheduler adds).
        self.num_lookahead_tokens = self.num_spec_tokens if self.drafter is not None else 0
        self.num_blocks = num_kv_blocks(
            config.cache,
            self.kv_spec,
            self.backend.cache_dtype(self.dtype),
            extra_bytes_per_block=0 if self.drafter is None else self.drafter.bytes_per_block(),
        )
        self.kv_cache = allocate_kv_cache(
            self.kv_spec,
            self.num_blocks,
            self.block_size,
            self.backend.cache_dtype(self.dtype),
            self.placement,
        )
        sched = config.scheduler
        if self.drafter is not None:
            self.drafter.allocate(self.num_blocks, sched.max_num_seqs, self.padded_vocab_size)
        # A lone request verifying k drafts runs 1 + k tokens: its own bucket, not the next power of two.
        extra_buckets = (1 + self.num_spec_tokens,) if self.num_spec_tokens else ()
        self.token_buckets = make_token_buckets(sched.max_num_batched_tokens, extra_buckets)
        self.max_num_seqs = sched.max_num_seqs
        self.max_blocks_per_seq = math.ceil(max_model_len / self.block_size)
        self.guard = CompileGuard(strict=config.compilation.strict_compile_guard)
        # Host-idle and device-idle time per step (num_steps, device_wait_s: the host blocked on results).
        self.timing = StepTiming()
        # The last step's sampled ids [max_num_seqs], which the next step may read on the device. Made
        # like the sampler's output (committed, replicated), so the forward that warm-up compiles with it
        # is the one every later step calls with the sampler's ids (a host array would key apart).
        self.last_sampled = self.placement.zeros((self.max_num_seqs,), np.int32, self.placement.replicated)

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

    def kv_bytes_per_block(self) -> int:
        return bytes_per_block(self.kv_spec, self.block_size, self.backend.cache_dtype(self.dtype))

    # -- compiling ------------------------------------------------------------------------------

    def warm_up(self) -> None:
        """Compile every token bucket and every sampler variant, then arm the compile guard
        (worker/warm_up.py)."""
        compile_all(self)
        self.guard.arm()

    def _num_seqs_for(self, num_tokens: int) -> int:
        return request_bucket(num_tokens, self.max_num_seqs)

    def _draft_probs(self, prob_rows) -> tuple:
        """The verifier's q arguments (a draft model's), or none."""
        return (None, None) if self.drafter is None else self.drafter.verify_args(prob_rows)

    # -- one step -------------------------------------------------------------------------------

    def _build_batch(self, scheduled, num_tokens: int) -> StepBatch:
        num_seqs = self._num_seqs_for(num_tokens)
        batch = build_step_batch(scheduled, num_tokens, num_seqs, self.max_blocks_per_seq, self.block_size)
        if self.num_spec_tokens:
            batch = _with_verify_indices(batch, build_spec_inputs(scheduled, num_seqs, self.num_spec_tokens))
        if self.lora is not None:
            batch = dataclasses.replace(batch, lora_slot_ids=np.zeros(num_tokens, np.int32))
        return self.placement.step_inputs(batch)

    def _forward_args(self, kv_cache: KVCache, batch: StepBatch) -> tuple:
        lora = None if self.lora is None else self.lora.batch(batch.lora_slot_ids)
        return (
            self.params,
            kv_cache,
            batch.input_ids,
            self.last_sampled,
            batch.prev_rows,
            batch.positions,
            batch.logits_indices,
            batch.md,
            lora,
        )

    def forward(self, kv_cache: KVCache, batch: StepBatch) -> tuple[jax.Array, jax.Array, KVCache]:
        """The model over one batch (host or device arrays): (hidden [T, D], the hidden of each
        sequence's sampled position [R, D], the updated cache). `kv_cache` is donated: use only the
        one returned. Where `batch.prev_rows` >= 0 the id is read from `last_sampled`."""
        return self._forward_fn(*self._forward_args(kv_cache, batch))

    def _run_forward(self, batch: StepBatch) -> tuple[jax.Array, jax.Array]:
        hidden, hidden_rd, self.kv_cache = self.forward(self.kv_cache, batch)
        return hidden, hidden_rd

    def prepare(self, scheduled, grammar_bitmask: np.ndarray | None = None) -> StepInputs:
        """The host arrays of one step (the part process 0 computes and sends to the others).
        `grammar_bitmask` [len(scheduled), W] int32: the tokens each row may sample, or None.

        Each request's part is built in isolation: one that raises is listed in `failed_req_ids`
        and its rows become dummies, so a bad request fails alone instead of taking the engine down.
        """
        failed: set[str] = set()
        num_real = sum(s.num_new_tokens for s in scheduled)
        num_tokens = pick_bucket(self.token_buckets, num_real)
        # Adapters first: a request whose adapter fails to load gets dummy rows in the batch below.
        lora_slot_ids = None if self.lora is None else self.lora.step_slot_ids(scheduled, num_tokens, failed)
        batch = build_step_batch(
            scheduled,
            num_tokens,
            self._num_seqs_for(num_tokens),
            self.max_blocks_per_seq,
            self.block_size,
            failed,
        )
        if lora_slot_ids is not None:
            batch = dataclasses.replace(batch, lora_slot_ids=lora_slot_ids)
        sampling = [s for s in scheduled if s.is_sampling]
        with_penalties = any(s.request.sampling_params.has_penalties for s in sampling) or any(
            s.sample_index < s.request.sampling_params.min_tokens for s in sampling
        )
        prompt_targets = None
        if any(s.request.sampling_params.prompt_logprobs is not None for s in scheduled):
            prompt_targets = np.zeros(num_tokens, np.int32)
            offset = 0
            for s in scheduled:
                isolate_failures(
                    failed, s, "building its prompt targets", _fill_prompt_targets, prompt_targets, offset, s
                )
                offset += s.num_new_tokens
        if self.num_spec_tokens:  # one mask per verified position when some row verifies drafts
            has_drafts = any(s.spec_token_ids for s in scheduled)
            grammar_bitmask = step_bitmask(grammar_bitmask, self.num_spec_tokens, has_drafts)
        sampling_st = sampling_tensors(
            scheduled,
            batch.num_padded_seqs,
            self.padded_vocab_size,
            with_penalties,
            failed=failed,
            grammar_bitmask=grammar_bitmask,
        )
        spec = None
        if self.num_spec_tokens:
            # Every step gathers K + 1 rows per sequence (one forward program per bucket); it verifies
            # only when some request carries drafts.
            spec = build_spec_inputs(scheduled, batch.num_padded_seqs, self.num_spec_tokens)
            batch = _with_verify_indices(batch, spec)
            spec = spec if spec.num_drafts.any() else None
        draft = None
        if self.drafter is not None:
            draft = self.drafter.prepare(scheduled, batch.num_padded_seqs, failed)
        return StepInputs(
            batch=batch,
            sampling=sampling_st,
            with_logprobs=any(s.request.sampling_params.logprobs is not None for s in sampling),
            prompt_targets=prompt_targets,
            failed_req_ids=frozenset(failed),
            spec=spec,
            draft=draft,
        )

    def run(self, inputs: StepInputs) -> dict[str, np.ndarray]:
        """The device half of a step, identical on every process: forward, sample, prompt logprobs."""
        return self.fetch(*self.dispatch(inputs))

    def dispatch(self, inputs: StepInputs) -> tuple[dict[str, jax.Array], object]:
        """Start a step on the device; returns its output arrays (not waited for) and its timing
        record. The sampled ids become `last_sampled`, which the next step may read."""
        ready = self.placement.step_inputs
        self.guard.begin()
        step = self.timing.on_dispatch()
        hidden, hidden_rd = self._run_forward(ready(inputs.batch))
        if inputs.spec is None:
            out: SamplerOutput
            out, self.last_sampled = self._sample_fn(
                self.head_params, hidden_rd, ready(inputs.sampling), with_logprobs=inputs.with_logprobs
            )
            device = {"token_ids": out.token_ids}
            num_accepted = None  # none: the draft model reads zeros
        else:  # synchronous (speculative decoding turns async scheduling off): last_sampled unused
            prob_rows = None if inputs.draft is None else inputs.draft.prob_rows
            out: VerifyOutput = self._verify_fn(
                self.head_params,
                hidden_rd,
                ready(inputs.sampling),
                ready(inputs.spec),
                *self._draft_probs(prob_rows),
                with_logprobs=inputs.with_logprobs,
            )
            device = {"token_ids": out.token_ids, "num_accepted": out.num_accepted}
            num_accepted = out.num_accepted
        if self.drafter is not None:  # the next step's drafts, from the tokens this one emitted
            device["draft_ids"] = self.drafter.step(
                ready(inputs.batch), out.token_ids, num_accepted, inputs.sampling, inputs.draft
            )
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

    def execute(self, scheduled, grammar_bitmask: np.ndarray | None = None) -> ModelRunnerOutput:
        """Run one step for `scheduled` (a list of ScheduledRequest) in this process alone."""
        return self.execute_async(scheduled, grammar_bitmask).result()

    def execute_async(self, scheduled, grammar_bitmask: np.ndarray | None = None) -> StepFuture:
        """Prepare and dispatch one step; its outputs are read when the future's `result()` is asked.
        Rows whose last id the previous step sampled read it from `last_sampled` on the device."""
        if not scheduled:
            return StepFuture.done(ModelRunnerOutput())
        inputs = self.prepare(scheduled, grammar_bitmask)
        device, step = self.dispatch(inputs)

        def read() -> ModelRunnerOutput:
            return make_output(scheduled, self.fetch(device, step), inputs.failed_req_ids)

        return StepFuture(read, inputs.failed_req_ids)

    def compiled_forward_text(self, num_tokens: int) -> str:
        """The optimized HLO of the forward for one token bucket (to inspect collectives)."""
        lowered = self._forward_fn.lower(
            *self._forward_args(self.kv_cache, self._build_batch([], num_tokens))
        )
        return lowered.compile().as_text()
