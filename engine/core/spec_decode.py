"""Speculative decoding's host side: the n-gram proposer and the acceptance counters. No jax.

The proposer runs after each step on the requests that are decoding and sets `request.spec_token_ids`;
the scheduler then gives such a request 1 + len(drafts) tokens (its last token and the drafts, as
ordinary tokens of the flat batch), the runner verifies them in that one forward and the scheduler
keeps the accepted ones, rolling `num_computed_tokens` back over the rejected ones (their K/V slots
are simply overwritten by later steps; see engine/SPEC_DECODE.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from xlaserve.core.request import Request, RequestStatus


@dataclass
class SpecDecodingStats:
    """Drafts proposed and accepted since the last snapshot (vLLM's spec_decode_* counters)."""

    num_spec_tokens: int = 0  # k: the length of `num_accepted_tokens_per_pos`
    num_drafts: int = 0  # verification rows (requests with at least one draft) in the steps
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [k]: accepted at draft i

    def __post_init__(self):
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's verification: `num_accepted_tokens` of its `num_draft_tokens` drafts kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    def add(self, other: SpecDecodingStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for i, n in enumerate(other.num_accepted_tokens_per_pos):
            self.num_accepted_tokens_per_pos[i] += n


def ngram_propose(token_ids: np.ndarray, num_speculative_tokens: int, min_n: int, max_n: int) -> np.ndarray:
    """Prompt-lookup decoding: for the longest n in [min_n, max_n] whose last n tokens occur earlier in
    `token_ids`, the (up to) k tokens that followed their earliest occurrence (vLLM's choice; on a
    copying workload the first occurrence is usually the prompt's, which the answer follows, where a
    later one is often the answer's own repetition: 2.01 against 1.95 tokens per step on
    `bench --workload copy`). [L] -> [<= k]."""
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = token_ids[length - n :]
        # Windows starting before length - n: each has at least one token after it.
        windows = np.lib.stride_tricks.sliding_window_view(token_ids[: length - 1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        starts = starts[starts < length - n]
        if len(starts):
            start = int(starts[0]) + n
            return token_ids[start : start + num_speculative_tokens]
    return token_ids[:0]


class NgramProposer:
    """Drafts for the running requests from their own tokens (prompt and output so far)."""

    def __init__(self, speculative_config, max_model_len: int):
        self.k = speculative_config.num_speculative_tokens
        self.min_n = speculative_config.prompt_lookup_min
        self.max_n = speculative_config.prompt_lookup_max
        self.max_model_len = max_model_len

    def propose(self, requests: list[Request], runner_output=None) -> None:
        """Set `spec_token_ids` of each request in `requests` (the scheduler's running list).
        `runner_output`: the last step's ModelRunnerOutput (unused: n-grams come from the tokens)."""
        for request in requests:
            num_drafts = self.max_num_drafts(request)
            request.spec_token_ids = []
            if num_drafts > 0:
                tokens = np.asarray(request.all_token_ids, np.int64)
                request.spec_token_ids = ngram_propose(tokens, num_drafts, self.min_n, self.max_n).tolist()

    def max_num_drafts(self, request: Request) -> int:
        """How many drafts `request` may carry in its next step (0: none).

        Only a decoding request drafts (never one still prefilling), and not one whose min_tokens still
        bans EOS and stop ids, nor one with a bad word of several tokens: the verify step gives every
        position of a row the row's one bias (the bans after the output so far), right at its first
        position only. A request under a grammar
        drafts: the engine then cuts its drafts where the grammar rejects one (the structured-output
        manager's `check_drafts`) and masks each verified position. The drafts leave room for the token
        verification adds, so a step never emits past max_tokens or max_model_len."""
        params = request.sampling_params
        if (
            request.status != RequestStatus.RUNNING
            or request.num_tokens - request.num_computed_tokens != 1
            or request.num_output_tokens < params.min_tokens
            or params.bans_follow_output
        ):
            return 0
        room = min(request.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens)
        return max(0, min(self.k, room - 1))


class DraftModelProposer(NgramProposer):
    """Drafts a draft network (worker/draft_model.py; an MTP layer: worker/mtp.py) proposed on the
    device during the last step, read from that step's ModelRunnerOutput; the same limits as the n-gram
    proposer's cut them."""

    def propose(self, requests: list[Request], runner_output=None) -> None:
        drafts = {} if runner_output is None else runner_output.draft_token_ids
        for request in requests:
            # Only the step just applied proposed for this request: a request it did not run (out of
            # budget, preempted) has none, and the runner's q for older drafts is gone.
            num_drafts = self.max_num_drafts(request)
            request.spec_token_ids = drafts.get(request.request_id, [])[:num_drafts] if num_drafts > 0 else []


def make_proposer(speculative_config, max_model_len: int) -> NgramProposer | None:
    """The host side of the configured method (None: speculative decoding off)."""
    if speculative_config is None:
        return None
    if speculative_config.has_draft_cache:  # a draft model's or an MTP layer's, proposed on the device
        return DraftModelProposer(speculative_config, max_model_len)
    return NgramProposer(speculative_config, max_model_len)
