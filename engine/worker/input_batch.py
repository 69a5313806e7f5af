"""Host-side assembly of one step's flat ragged batch, as numpy; the runner transfers it in one put."""

from __future__ import annotations

import dataclasses
import io
import logging
from dataclasses import dataclass, field

import jax
import numpy as np

from xlaserve.core.kv_connector import KVConnectorMetadata
from xlaserve.kernels import AttentionMetadata
from xlaserve.worker.sampler import BITS_PER_WORD, SamplingTensors
from xlaserve.worker.spec_decode import SpecInputs

logger = logging.getLogger(__name__)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepBatch:
    input_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32
    logits_indices: jax.Array  # [R] int32: the token of each sequence that is sampled
    # [T] int32: for a token sampled by the previous step, still on the device (async scheduling),
    # its row in that step's sampled ids, which replace input_ids there; -1 elsewhere.
    prev_rows: jax.Array
    md: AttentionMetadata
    num_padded_seqs: int = field(metadata={"static": True})


def build_step_batch(
    scheduled,
    num_tokens: int,
    num_seqs: int,
    max_blocks_per_seq: int,
    block_size: int,
    failed: set[str] | None = None,
    layout=None,
    num_blocks: int = 0,
) -> StepBatch:
    """Pad `scheduled` (ScheduledRequest list) to `num_tokens` tokens and `num_seqs` sequences.
    `layout`: the layers' groups when they keep several block tables (worker/kv_cache_groups.py
    `CacheLayout`; `num_blocks` is the pool's): each group's table and slot mapping are built too.

    Padding tokens write to slot 0 (the null block) and belong to no sequence; padding
    sequences have kv_len 0 and start where the real tokens end, so they own no query.

    A request whose rows cannot be built is added to `failed` and its rows become a dummy
    sequence over the null block: the batch keeps its layout, the others run, and nothing
    touches that request's blocks (see `isolate_failures`).
    """
    failed = set() if failed is None else failed
    input_ids = np.zeros(num_tokens, np.int32)
    prev_rows = np.full(num_tokens, -1, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    query_start_loc = np.zeros(num_seqs + 1, np.int32)
    kv_lens = np.zeros(num_seqs, np.int32)
    logits_indices = np.zeros(num_seqs, np.int32)
    state_slots = np.zeros(num_seqs, np.int32)
    num_groups = 1 if layout is None else layout.num_groups
    group_tables = np.zeros((num_groups, num_seqs, max_blocks_per_seq), np.int32)
    group_slots = np.zeros((num_groups, num_tokens), np.int32)
    arrays = (input_ids, positions, kv_lens, group_tables, group_slots, prev_rows, state_slots)
    offset = 0
    for row, s in enumerate(scheduled):
        n = s.num_new_tokens
        if isolate_failures(
            failed, s, "building its rows of the batch", _fill_row, arrays, row, offset, s, block_size
        ):
            _blank_row(arrays, row, offset, n)
        offset += n
        query_start_loc[row + 1] = offset
        logits_indices[row] = offset - 1
    if failed:
        for row in _rows_reading_failed_writes(scheduled, failed, block_size):
            _blank_row(arrays, row, int(query_start_loc[row]), scheduled[row].num_new_tokens)
    query_start_loc[len(scheduled) + 1 :] = offset
    md = AttentionMetadata(
        slot_mapping=group_slots[0],
        kv_lens=kv_lens,
        block_tables=group_tables[0],
        query_start_loc=query_start_loc,
        num_seqs=np.int32(len(scheduled)),
        state_slots=state_slots,
    )
    if layout is not None:
        md = dataclasses.replace(
            md,
            group_block_tables=group_tables,
            group_slot_mappings=group_slots,
            layer_groups=layout.layer_groups,
            layer_block_offsets=layout.layer_block_offsets(num_blocks),
        )
    return StepBatch(input_ids, positions, logits_indices, prev_rows, md, num_seqs)


def isolate_failures(failed: set[str], s, what: str, fill, *args) -> bool:
    """Run one request's host work `fill(*args)`; on an exception log it, add the request to `failed`
    and return True. A fault in one request's data must fail that request, not the engine."""
    if failed and s.request_id in failed:
        return True
    try:
        fill(*args)
    except Exception:
        logger.exception("request %r failed while %s; it finishes with an error", s.request_id, what)
        failed.add(s.request_id)
        return True
    return False


def _fill_row(arrays, row: int, offset: int, s, block_size: int) -> None:
    input_ids, positions, kv_lens, group_tables, group_slots, prev_rows, state_slots = arrays
    start, n = s.num_computed_tokens, s.num_new_tokens
    tables = (s.block_ids, *s.group_block_ids)
    if len(tables) != len(group_tables):
        raise ValueError(f"{len(tables)} block tables for a step of {len(group_tables)} KV cache groups")
    state_slots[row] = s.state_slot
    known = s.token_ids  # speculative drafts last
    if len(known) < n:  # the last id is the previous step's sample, still on the device
        if s.prev_sampled_row < 0 or len(known) != n - 1:
            raise ValueError(f"{n - len(known)} token ids unknown at the end of the step's {n}")
        prev_rows[offset + n - 1] = s.prev_sampled_row
    input_ids[offset : offset + len(known)] = known
    pos = np.arange(start, start + n, dtype=np.int32)
    positions[offset : offset + n] = pos
    for group, table in enumerate(tables):
        block_ids = np.asarray(table, np.int32)
        group_tables[group, row, : len(block_ids)] = block_ids
        group_slots[group, offset : offset + n] = block_ids[pos // block_size] * block_size + pos % block_size
    kv_lens[row] = start + n


def _blank_row(arrays, row: int, offset: int, n: int) -> None:
    """A failed request's rows: n tokens at positions 0..n-1 whose K/V goes to, and whose context is
    read from, the null block only; their outputs are discarded."""
    input_ids, positions, kv_lens, group_tables, group_slots, prev_rows, state_slots = arrays
    group_tables[:, row] = 0
    state_slots[row] = 0
    prev_rows[offset : offset + n] = -1
    input_ids[offset : offset + n] = 0
    positions[offset : offset + n] = np.arange(n, dtype=np.int32)
    group_slots[:, offset : offset + n] = 0
    kv_lens[row] = n


def _rows_reading_failed_writes(scheduled, failed: set[str], block_size: int) -> list[int]:
    """Rows of requests that read a block a failed request was to write in this step (a prefix-cache
    hit on a block filled in the same step); they are failed too, transitively, since the K/V they
    would read is never written. Returns their row numbers, adding their ids to `failed`."""

    def touched(s, *, written_only: bool) -> set[int]:
        last = (s.num_computed_tokens + s.num_new_tokens - 1) // block_size
        first = s.num_computed_tokens // block_size if written_only else 0
        return set(s.block_ids[first : last + 1])

    rows = []
    unwritten: set[int] = set()
    for s in scheduled:
        if s.request_id in failed:
            unwritten |= touched(s, written_only=True)
    is_growing = True
    while is_growing:
        is_growing = False
        for row, s in enumerate(scheduled):
            if s.request_id not in failed and touched(s, written_only=False) & unwritten:
                logger.error(
                    "request %r reads KV blocks a failed request did not write; it finishes with an error",
                    s.request_id,
                )
                failed.add(s.request_id)
                unwritten |= touched(s, written_only=True)
                rows.append(row)
                is_growing = True
    return rows


def sampling_tensors(
    scheduled,
    num_seqs: int,
    vocab_size: int,
    with_penalties: bool,
    *,
    failed: set[str] | None = None,
    grammar_bitmask: np.ndarray | None = None,
) -> SamplingTensors:
    """Per-row sampling parameters; padding rows are greedy. The [R, V] penalty arrays are built only
    when some row needs them (penalties, a logit bias or allowed token ids, or min_tokens keeping EOS
    and stop ids out); the token
    bitmask only when some row samples under a grammar (`grammar_bitmask`: [len(scheduled), W]).

    Rows of requests in (or added to) `failed` keep the padding rows' values."""
    failed = set() if failed is None else failed
    temperature = np.zeros(num_seqs, np.float32)
    top_k = np.zeros(num_seqs, np.int32)
    top_p = np.ones(num_seqs, np.float32)
    min_p = np.zeros(num_seqs, np.float32)
    seeds = np.zeros(num_seqs, np.uint32)
    token_index = np.zeros(num_seqs, np.int32)
    scalars = (temperature, top_k, top_p, min_p, seeds, token_index)
    for row, s in enumerate(scheduled):
        if isolate_failures(
            failed, s, "building its sampling parameters", _fill_sampling_row, scalars, row, s
        ):
            for array, value in zip(scalars, (0, 0, 1, 0, 0, 0)):
                array[row] = value
    extra = {}
    if with_penalties:
        presence = np.zeros(num_seqs, np.float32)
        frequency = np.zeros(num_seqs, np.float32)
        repetition = np.ones(num_seqs, np.float32)
        counts = np.zeros((num_seqs, vocab_size), np.int32)
        prompt_mask = np.zeros((num_seqs, vocab_size), bool)
        bias = np.zeros((num_seqs, vocab_size), np.float32)
        penalties = (presence, frequency, repetition, counts, prompt_mask, bias)
        for row, s in enumerate(scheduled):
            if isolate_failures(failed, s, "building its penalties", _fill_penalty_row, penalties, row, s):
                for array, value in zip(penalties, (0, 0, 1, 0, False, 0)):
                    array[row] = value
                for array, value in zip(scalars, (0, 0, 1, 0, 0, 0)):
                    array[row] = value
        extra = {
            "presence_penalty": presence,
            "frequency_penalty": frequency,
            "repetition_penalty": repetition,
            "output_counts": counts,
            "prompt_mask": prompt_mask,
            "logit_bias": bias,
        }
    if grammar_bitmask is not None:
        extra["allowed_token_bitmask"] = fit_bitmask(grammar_bitmask, num_seqs, vocab_size)
    return SamplingTensors(temperature, top_k, top_p, min_p, seeds, token_index, **extra)


def _fill_sampling_row(scalars, row: int, s) -> None:
    temperature, top_k, top_p, min_p, seeds, token_index = scalars
    p, req = s.request.sampling_params, s.request
    temperature[row], top_k[row], top_p[row], min_p[row] = p.temperature, p.top_k, p.top_p, p.min_p
    seeds[row] = req.sampling_seed & 0xFFFFFFFF
    token_index[row] = s.sample_index  # placeholders (async scheduling) count


def _fill_penalty_row(penalties, row: int, s) -> None:
    presence, frequency, repetition, counts, prompt_mask, bias = penalties
    p, req = s.request.sampling_params, s.request
    presence[row], frequency[row], repetition[row] = (
        p.presence_penalty,
        p.frequency_penalty,
        p.repetition_penalty,
    )
    np.add.at(counts[row], np.asarray(req.output_token_ids, np.int64), 1)
    prompt_mask[row, req.prompt_token_ids] = True
    if p.logit_bias:
        bias[row, np.fromiter(p.logit_bias, np.int64)] += np.fromiter(p.logit_bias.values(), np.float32)
    output = req.output_token_ids
    for ids in p.bad_words_token_ids or ():  # a word's last token, where the output ends with the rest
        prefix = ids[:-1]
        if not prefix or (len(output) >= len(prefix) and list(output[len(output) - len(prefix) :]) == prefix):
            bias[row, ids[-1]] = -np.inf
    if p.allowed_token_ids is not None:  # the others (the vocabulary's padding too) never sampled
        allowed = np.zeros(bias.shape[1], bool)
        allowed[p.allowed_token_ids] = True
        bias[row, ~allowed] = -np.inf
    if s.sample_index < p.min_tokens:
        banned = list(p.stop_token_ids or [])
        if req.eos_token_id is not None and not p.ignore_eos:
            banned.append(req.eos_token_id)
        bias[row, banned] = -np.inf


def fit_bitmask(grammar_bitmask: np.ndarray, num_seqs: int, vocab_size: int) -> np.ndarray:
    """The grammar's bitmask [N, W] (N scheduled rows, W words for the tokenizer's vocabulary) as the
    sampler takes it, [num_seqs, ceil(vocab_size / 32)]: padding rows allow everything (they are
    discarded), and ids past the grammar's vocabulary (the logits' padding) are never allowed under a
    grammar. A row no grammar constrains (all ones) allows them, as a step without grammars does: its
    logprobs' normalizer must not change with a grammar request beside it (batch invariance; a model's
    logits can be wider than its tokenizer, Qwen's 151936 over 151669 ids). A mask per verified position,
    [N, P, W] (speculative decoding), becomes [num_seqs, P, ceil(vocab_size / 32)]."""
    width = -(-vocab_size // BITS_PER_WORD)
    fitted = np.zeros((num_seqs, *grammar_bitmask.shape[1:-1], width), np.int32)
    num_rows, num_words = len(grammar_bitmask), min(width, grammar_bitmask.shape[-1])
    fitted[:num_rows, ..., :num_words] = grammar_bitmask[..., :num_words]
    free = (grammar_bitmask == -1).all(axis=-1)  # [N] or [N, P]: rows (positions) no grammar constrains
    fitted[:num_rows][free, num_words:] = -1
    fitted[num_rows:] = -1
    return fitted


@dataclass(frozen=True)
class StepInputs:
    """Everything one step's device calls consume, as host arrays: what process 0 sends to the
    other processes of a multi-host engine so that they run the same jitted step."""

    batch: StepBatch
    sampling: SamplingTensors
    with_logprobs: bool
    prompt_targets: np.ndarray | None  # [T] int32 when some request asked for prompt logprobs
    # Requests whose host work failed (process 0 only, never sent): their rows are dummies and the
    # scheduler finishes them with an error.
    failed_req_ids: frozenset[str] = frozenset()
    spec: SpecInputs | None = None  # speculative drafts to verify, when some request has any
    # Each feature hook's host arrays, by hook name (worker/step_hooks.py): {} with no feature on.
    hooks: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    # The KV connector's transfers before the step (core/kv_connector.py); process 0's alone, never sent
    # (EngineConfig refuses a connector on several hosts).
    kv_connector_metadata: KVConnectorMetadata | None = None
    # Copies between state slots (src, dst) before and after the forward: a prefix hit's snapshot in,
    # a new snapshot out (worker/state_copies.py); None: none.
    state_copies: tuple[np.ndarray, np.ndarray] | None = None

    def to_bytes(self) -> bytes:
        arrays = {f"batch.{k}": v for k, v in _fields(self.batch).items() if v is not None}
        arrays |= {f"md.{k}": v for k, v in _fields(self.batch.md).items() if v is not None}
        arrays |= {f"sampling.{k}": v for k, v in _fields(self.sampling).items() if v is not None}
        arrays["with_logprobs"] = np.asarray(self.with_logprobs)
        if self.prompt_targets is not None:
            arrays["prompt_targets"] = self.prompt_targets
        if self.spec is not None:
            arrays |= {f"spec.{k}": v for k, v in _fields(self.spec).items()}
        if self.state_copies is not None:
            arrays["state_copies.in"], arrays["state_copies.out"] = self.state_copies
        for name, hook_arrays in self.hooks.items():
            arrays |= {f"hook.{name}.{k}": v for k, v in hook_arrays.items()}
            arrays[f"hooks.{name}"] = np.asarray(len(hook_arrays))  # a hook with no arrays is still sent
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> StepInputs:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}

        def group(prefix: str) -> dict[str, np.ndarray]:
            return {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}

        batch = group("batch.")
        batch["num_padded_seqs"] = int(batch["num_padded_seqs"])
        hooks = {name: group(f"hook.{name}.") for name in group("hooks.")}
        return cls(
            batch=StepBatch(md=AttentionMetadata(**group("md.")), **batch),
            sampling=SamplingTensors(**group("sampling.")),
            with_logprobs=bool(arrays["with_logprobs"]),
            prompt_targets=arrays.get("prompt_targets"),
            spec=SpecInputs(**group("spec.")) if "spec.num_drafts" in arrays else None,
            hooks=hooks,
            state_copies=(
                (arrays["state_copies.in"], arrays["state_copies.out"])
                if "state_copies.in" in arrays
                else None
            ),
        )


def _fields(obj) -> dict[str, object]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.name != "md"}
