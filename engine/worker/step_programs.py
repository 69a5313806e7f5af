"""The device functions of a step (the model forward, the sampler, speculative verification, prompt
logprobs) and the Programs a runner calls them through.

Each is jitted once per runner with its graphdef bound (a closure, not a static argument: hashing a
model's graphdef costs ~0.3 ms on every call), and traces under the engine's batch invariance
(kernels/invariant.py). A Program (worker/program.py) calls the executable warm-up loaded or compiled
for its shapes; the weights (and the KV cache) lead, outside the per-call signature.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from xlaserve.kernels.dot_rows import traced_probing
from xlaserve.kernels.invariant import traced_with
from xlaserve.sampling_params import DEFAULT_MAX_LOGPROBS
from xlaserve.sharding.vocab import mask_padded_vocab
from xlaserve.worker.program import Program
from xlaserve.worker.sampler import prompt_logprobs, sample
from xlaserve.worker.spec_decode import SpecInputs, verify


def _forward(
    graphdef,
    token_sharding,
    params,
    kv_cache,
    input_ids,
    prev_ids,
    prev_rows,
    positions,
    logits_indices,
    md,
    model_inputs,
):
    """-> (hidden [T, D], hidden of each sequence's sampled position [R, D], kv_cache), and the aux
    hidden states [T, n * D] last where the hooks ask for them (an EAGLE-3 drafter's `aux_layers=`).
    prev_ids [S]: the previous step's sampled ids, still on the device; prev_rows [T]: where >= 0, the
    row of prev_ids that is this token's id (async scheduling). `model_inputs`: the hooks' keyword
    arguments of the model (LoRA's `lora=`); empty, the program is the base model's. `token_sharding`:
    None, or (prefill context parallel) the tokens split over the mesh's "context" axis, from which
    XLA splits the step's work."""
    input_ids = jnp.where(prev_rows >= 0, prev_ids[jnp.maximum(prev_rows, 0)], input_ids)
    if token_sharding is not None:
        input_ids = jax.lax.with_sharding_constraint(input_ids, token_sharding)
        positions = jax.lax.with_sharding_constraint(positions, token_sharding)
    model = nnx.merge(graphdef, params)
    hidden, kv_cache, *aux = model(input_ids, positions, kv_cache, md, **model_inputs)
    return hidden, hidden[logits_indices], kv_cache, *aux


def _logits(graphdef, vocab_size, head_params, hidden):
    """[N, D] -> [N, V_padded] float32, padding ids at -inf (sharding/vocab.py): never sampled, never
    in logprobs. `head_params`: (the model's params, the LM head as [D, V] or None)."""
    params, head_dv = head_params
    return mask_padded_vocab(nnx.merge(graphdef, params).compute_logits(hidden, head_dv), vocab_size)


def _sample(graphdef, vocab_size, num_ids, logprobs, params, hidden_rd, st, *, with_logprobs):
    """-> (SamplerOutput, the sampled ids padded to [num_ids] for the next step's forward)."""
    num_seqs = st.temperature.shape[0]
    if hidden_rd.shape[0] != num_seqs:  # speculative decoding gathers K + 1 rows per sequence: the first
        hidden_rd = hidden_rd.reshape(num_seqs, -1, hidden_rd.shape[-1])[:, 0]
    logits = _logits(graphdef, vocab_size, params, hidden_rd)
    out = sample(logits, st, with_logprobs=with_logprobs, **logprobs)
    return out, jnp.pad(out.token_ids, (0, num_ids - out.token_ids.shape[0]))


def _verify(
    graphdef, vocab_size, logprobs, params, hidden_rd, st, spec: SpecInputs, draft_q, *, with_logprobs
):
    """Speculative decoding: logits at each request's K + 1 verified positions (hidden_rd
    [R * (K + 1), D], gathered by the forward at spec.verify_indices), then rejection sampling.
    `draft_q`: a draft model's (q_buf [S, K, V], rows [R]) (worker/draft_model.py), or None (n-gram)."""
    logits = _logits(graphdef, vocab_size, params, hidden_rd)
    draft_probs = None if draft_q is None else draft_q[0][draft_q[1]]
    return verify(logits, st, spec, with_logprobs=with_logprobs, draft_probs=draft_probs, **logprobs)


def _prompt_logprobs(graphdef, vocab_size, max_logprobs, params, hidden, target_ids):
    return prompt_logprobs(_logits(graphdef, vocab_size, params, hidden), target_ids, max_logprobs)


@dataclass(frozen=True)
class StepPrograms:
    forward: Program  # the KV cache donated, updated in place
    sample: Program
    prompt_logprobs: Program
    verify: Program


def make_step_programs(
    graphdef,
    vocab_size: int,
    max_num_seqs: int,
    batch_invariant: bool,
    compiler_options: dict | None = None,
    token_sharding=None,
    probe_dot_rows: bool = False,
    float32_invariant: bool = False,
    logprobs_mode: str = "raw_logprobs",
    max_logprobs: int = DEFAULT_MAX_LOGPROBS,
) -> StepPrograms:
    """The four programs of a step for the model `graphdef` (its real, unpadded `vocab_size`), compiled
    with `compiler_options` (CompilationConfig.compiler_options: the engine's optimization level).
    `token_sharding`: the forward's tokens split over devices (prefill context parallel), or None.
    `probe_dot_rows`: few-row 16-bit dots padded to their shape's probed rows (kernels/dot_rows.py: an
    engine on one device), else to the fixed bound. `float32_invariant`: float32 dots batch-invariant too
    (kernels/invariant.py `covers_float32`). `logprobs_mode`: what the sampler's and the verifier's
    logprobs are of (sampler.py); `max_logprobs`: how many top logprobs they (and prompt logprobs)
    return, a static width (ModelConfig.max_logprobs resolved against the vocabulary)."""

    def invariant(fn):
        return traced_with(batch_invariant, traced_probing(probe_dot_rows, fn), float32_invariant)

    jit = partial(jax.jit, compiler_options=compiler_options)
    logprobs = {"logprobs_mode": logprobs_mode, "max_logprobs": max_logprobs}
    return StepPrograms(
        forward=Program(
            "forward",
            jit(invariant(partial(_forward, graphdef, token_sharding)), donate_argnames=("kv_cache",)),
            num_fixed_args=2,
        ),
        # `with_logprobs` is traced (a runtime flag), not static: warm-up compiles 4 sampler programs
        # per request bucket (penalties x grammar), not 8 (sampler.py).
        sample=Program(
            "sample", jit(invariant(partial(_sample, graphdef, vocab_size, max_num_seqs, logprobs)))
        ),
        prompt_logprobs=Program(
            "prompt_logprobs", jit(invariant(partial(_prompt_logprobs, graphdef, vocab_size, max_logprobs)))
        ),
        # The same for verification: 4 verify programs per request bucket, not 8 (spec_decode.py).
        verify=Program("verify", jit(invariant(partial(_verify, graphdef, vocab_size, logprobs)))),
    )
