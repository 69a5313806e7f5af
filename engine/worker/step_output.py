"""A step's outputs on the host: per request, the sampled id, drafts, logprobs and prompt logprobs.

The runner brings a step's device arrays to the host (`to_host`) and reads each scheduled request's
row from them here; a request whose row cannot be read is reported failed, alone (`isolate_failures`).
"""

from __future__ import annotations

import jax
import numpy as np

from xlaserve.core.outputs import ModelRunnerOutput
from xlaserve.worker.input_batch import isolate_failures


def to_host(array: jax.Array) -> np.ndarray:
    """A replicated array's value; across processes, from this process's own copy."""
    if array.is_fully_addressable:
        return np.asarray(array)
    return np.asarray(array.addressable_data(0))


def _entry(host: dict, prefix: str, row: int, n: int):
    """One position's LogprobsEntry: the token first, then the top n."""
    ids, vals, ranks = host[f"{prefix}_ids"], host[f"{prefix}_vals"], host[f"{prefix}_ranks"]
    return (ids[row, : n + 1].tolist(), vals[row, : n + 1].tolist(), int(ranks[row]))


def _read_outputs(result: ModelRunnerOutput, host: dict[str, np.ndarray], row: int, offset: int, s) -> None:
    """One request's sampled id and logprobs from the step's host arrays, into `result`."""
    req = s.request
    rid = req.request_id
    if req.sampling_params.prompt_logprobs is not None:
        n = req.sampling_params.prompt_logprobs
        length = max(
            0,
            min(s.num_computed_tokens + s.num_new_tokens, req.num_prompt_tokens - 1) - s.num_computed_tokens,
        )
        if length:
            result.prompt_logprobs[rid] = [_entry(host, "plp", i, n) for i in range(offset, offset + length)]
    if not s.is_sampling:
        return
    result.sampled_token_ids[rid] = int(host["token_ids"][row])
    if "draft_ids" in host:  # up to the first -1 (a position the draft model had no slot for)
        drafts = host["draft_ids"][row].tolist()
        result.draft_token_ids[rid] = drafts[: drafts.index(-1)] if -1 in drafts else drafts
    num_logprobs = req.sampling_params.logprobs
    if "num_accepted" not in host:
        if num_logprobs is not None:
            result.logprobs[rid] = [_entry(host, "lp", row, num_logprobs)]
        return
    # A verification step: the accepted drafts, then the sampled token; one logprob entry for each.
    num_accepted = int(host["num_accepted"][row])
    if s.spec_token_ids:
        result.accepted_token_ids[rid] = s.spec_token_ids[:num_accepted]
    if num_logprobs is not None:
        ids, vals, ranks = host["lp_ids"][row], host["lp_vals"][row], host["lp_ranks"][row]
        result.logprobs[rid] = [
            (ids[j, : num_logprobs + 1].tolist(), vals[j, : num_logprobs + 1].tolist(), int(ranks[j]))
            for j in range(num_accepted + 1)
        ]


def make_output(
    scheduled, host: dict[str, np.ndarray], failed_req_ids: frozenset[str] = frozenset(), hooks=()
) -> ModelRunnerOutput:
    """Per request: the sampled id, and the logprobs it asked for, from a step's host arrays, then
    what each of `hooks` reads (a pooling request's pooled output). Requests in `failed_req_ids`, or
    whose outputs cannot be read, are reported as failed."""
    result = ModelRunnerOutput(failed_req_ids=set(failed_req_ids))
    offset = 0
    for row, s in enumerate(scheduled):
        isolate_failures(
            result.failed_req_ids, s, "reading its outputs", _read_outputs, result, host, row, offset, s
        )
        offset += s.num_new_tokens
    for hook in hooks:
        hook.read_output(scheduled, host, result)
    for rid in result.failed_req_ids:
        # Whatever was read before the failure must not reach the scheduler as a sampled token.
        result.sampled_token_ids.pop(rid, None)
        result.logprobs.pop(rid, None)
        result.prompt_logprobs.pop(rid, None)
        result.draft_token_ids.pop(rid, None)
        result.pooler_output.pop(rid, None)
    return result
