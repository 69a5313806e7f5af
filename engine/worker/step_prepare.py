"""The host half of a step: the scheduled requests as the arrays the device programs read.

`StepPreparation` is the model runner's (worker/model_runner.py) part that runs on the host before a
dispatch: the token bucket, the hooks' arrays (worker/step_hooks.py), the flat ragged batch
(worker/input_batch.py) with its verified positions (worker/spec_decode.py), the prompt logprobs'
targets and the sampling tensors, gathered into one `StepInputs`, the part process 0 computes and sends
to the others (executor/multihost.py). It reads what `ModelRunner.__init__` set (the buckets, the hooks,
the block sizes and tables, `num_spec_tokens`, the vocabulary's width).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from xlaserve.core.kv_connector import KVConnectorMetadata
from xlaserve.sharding.context_parallel import physical_slot_mapping
from xlaserve.worker.buckets import pick_bucket, request_bucket
from xlaserve.worker.input_batch import (
    StepBatch,
    StepInputs,
    build_step_batch,
    isolate_failures,
    sampling_tensors,
)
from xlaserve.worker.spec_decode import SpecInputs, build_spec_inputs, step_bitmask
from xlaserve.worker.state_copies import step_state_copies


def _fill_prompt_targets(prompt_targets: np.ndarray, offset: int, s) -> None:
    req, start = s.request, s.num_computed_tokens
    stop = min(start + s.num_new_tokens, req.num_prompt_tokens - 1)
    if stop > start:  # positions whose next token is still a prompt token
        prompt_targets[offset : offset + stop - start] = req.prompt_token_ids[start + 1 : stop + 1]


def _with_verify_indices(batch: StepBatch, spec: SpecInputs) -> StepBatch:
    """The forward gathers K + 1 rows per sequence (K = 0: the sampled position alone, as built)."""
    return dataclasses.replace(batch, logits_indices=spec.verify_indices.reshape(-1))


class StepPreparation:
    """The model runner's host half of a step (module doc); `ModelRunner` builds on it."""

    def _num_seqs_for(self, num_tokens: int) -> int:
        return request_bucket(num_tokens, self.max_num_seqs, self.lone_buckets)

    def _prepare_hooks(self, scheduled, num_tokens: int, failed: set[str]) -> dict:
        num_seqs = self._num_seqs_for(num_tokens)
        return {hook.name: hook.prepare(scheduled, num_tokens, num_seqs, failed) for hook in self.hooks}

    def _step_batch(self, scheduled, num_tokens: int, failed: set[str]) -> tuple[StepBatch, SpecInputs]:
        """The flat batch (host arrays) and its verified positions. Every step gathers K + 1 rows per
        sequence (one forward program per bucket; K = 0 without speculation)."""
        num_seqs = self._num_seqs_for(num_tokens)
        batch = build_step_batch(
            scheduled,
            num_tokens,
            num_seqs,
            self.max_blocks_per_seq,
            self.block_size,
            failed,
            self.cache_layout,
            self.num_blocks,
        )
        if self.dcp > 1:  # the owning rank's slot (its rank is the token's position mod dcp)
            slots = physical_slot_mapping(batch.md.slot_mapping, self.block_size, self.dcp)
            batch = dataclasses.replace(batch, md=dataclasses.replace(batch.md, slot_mapping=slots))
        spec = build_spec_inputs(scheduled, num_seqs, self.num_spec_tokens)
        return _with_verify_indices(batch, spec), spec

    def _build_batch(self, scheduled, num_tokens: int) -> StepBatch:
        """An empty step's batch (warm-up, HLO inspection), ready for the device."""
        return self.placement.step_inputs(self._step_batch(scheduled, num_tokens, set())[0])

    def prepare(
        self,
        scheduled,
        grammar_bitmask: np.ndarray | None = None,
        kv_connector_metadata: KVConnectorMetadata | None = None,
    ) -> StepInputs:
        """The host arrays of one step (the part process 0 computes and sends to the others).
        `grammar_bitmask` [len(scheduled), W] int32: the tokens each row may sample, or None.
        `kv_connector_metadata`: the KV connector's transfers before the step (None: none).

        Each request's part is built in isolation: one that raises is listed in `failed_req_ids`
        and its rows become dummies, so a bad request fails alone instead of taking the engine down.
        """
        failed: set[str] = set()
        num_real = sum(s.num_new_tokens for s in scheduled)
        num_tokens = pick_bucket(self.token_buckets, num_real, len(scheduled), self._num_seqs_for)
        # The hooks first: a request a feature fails (an adapter that cannot load) gets dummy rows below.
        hook_arrays = self._prepare_hooks(scheduled, num_tokens, failed)
        batch, spec = self._step_batch(scheduled, num_tokens, failed)
        sampling = [s for s in scheduled if s.is_sampling]
        with_penalties = any(
            s.request.sampling_params.has_penalties
            or s.request.sampling_params.has_token_biases
            or s.sample_index < s.request.sampling_params.min_tokens
            for s in sampling
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
        # The step verifies only when some request carries drafts, with one grammar mask per position.
        has_drafts = bool(spec.num_drafts.any())
        grammar_bitmask = step_bitmask(grammar_bitmask, self.num_spec_tokens, has_drafts)
        sampling_st = sampling_tensors(
            scheduled,
            batch.num_padded_seqs,
            self.padded_vocab_size,
            with_penalties,
            failed=failed,
            grammar_bitmask=grammar_bitmask,
        )
        return StepInputs(
            batch=batch,
            sampling=sampling_st,
            with_logprobs=any(s.request.sampling_params.logprobs is not None for s in sampling),
            prompt_targets=prompt_targets,
            failed_req_ids=frozenset(failed),
            spec=spec if has_drafts else None,
            hooks=hook_arrays,
            kv_connector_metadata=kv_connector_metadata,
            state_copies=step_state_copies(scheduled, failed) if self.state_copier is not None else None,
        )
