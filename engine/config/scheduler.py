"""The scheduler: token and sequence budgets per step, chunked prefill, policy."""

from __future__ import annotations

from dataclasses import dataclass, field

from xlaserve.config.checks import require
from xlaserve.config_args import arg, not_a_flag

_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = field(default=64, metadata=arg("requests in one step (default: 64)"))
    max_num_batched_tokens: int = field(default=512, metadata=arg("tokens in one step (default: 512)"))
    policy: str = field(
        default="fcfs",
        metadata=arg(
            "who is admitted (and preempted) first: fcfs, or priority (a request's priority, then arrival)",
            flag="--scheduling-policy",
            choices=_POLICIES,
        ),
    )
    max_num_queued_reqs: int | None = field(  # bound on waiting requests (server: 503 past it)
        default=None, metadata=not_a_flag("the server's --max-num-queued-reqs")
    )
    # Fairness under long prompts (vLLM's names). A prefill chunk is capped at the threshold (None:
    # a quarter of max_num_batched_tokens; 0: no cap) and at most max_num_partial_prefills prompts
    # (max_long_partial_prefills of them longer than the threshold) are prefilled across steps at
    # once, so partial prefills take at most half of each step's budget by default: the other half
    # always serves decodes and short prompts, whose first token then comes within a step or two. The
    # default cap is fairness to others: a prompt alone in the engine takes the whole budget.
    long_prefill_token_threshold: int | None = field(
        default=None,
        metadata=arg(
            "cap on a prompt's prefill chunk per step, so one long prompt cannot take a whole step "
            "(default: max_num_batched_tokens / 4 while other requests run, none alone; 0: no cap)"
        ),
    )
    # vLLM's flag. Off: a prompt's missing tokens are computed in one step or wait for one with room,
    # so a prompt cannot be longer than a step (max_model_len is held to max_num_batched_tokens).
    enable_chunked_prefill: bool = field(
        default=True,
        metadata=arg(
            "split a long prompt's prefill across steps (default: on; off: each prompt is computed whole "
            "in one step, and max_model_len is held to max_num_batched_tokens)"
        ),
    )
    max_num_partial_prefills: int = field(
        default=2, metadata=arg("prompts prefilled across steps at once (default: 2)")
    )
    max_long_partial_prefills: int = field(
        default=2, metadata=arg("of those, prompts longer than the threshold (default: 2)")
    )
    # vLLM's async scheduling: the host schedules step N+1 while the device runs step N (None: on
    # wherever the executor supports it, i.e. one process, and the devices are not the host's own CPU
    # cores; the engine core logs why where not).
    async_scheduling: bool | None = field(
        default=None,
        metadata=arg(
            "schedule step N+1 while the device runs step N (default: on where supported, off on CPU devices)"
        ),
    )

    # vLLM's flag: a model whose attention layers slide by different windows (Gemma 2/3, gpt-oss) keeps
    # one block table per window group, so blocks behind a window go back to the pool; True: one table
    # for every layer (each layer keeps every token's K/V, as full attention does).
    disable_hybrid_kv_cache_manager: bool = field(
        default=False,
        metadata=arg(
            "one KV block table for every layer, even where some layers slide by a window (default: "
            "a table per window group, which frees the blocks a window left behind)"
        ),
    )

    def __post_init__(self):
        require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        require(
            self.max_num_batched_tokens >= 16,
            f"max_num_batched_tokens must be >= 16, got {self.max_num_batched_tokens}",
        )
        require(self.policy in _POLICIES, f"policy must be one of {_POLICIES}, got {self.policy!r}")
        require(
            self.long_prefill_token_threshold is None or self.long_prefill_token_threshold >= 0,
            f"long_prefill_token_threshold must be >= 0 (0: no cap), got {self.long_prefill_token_threshold}",
        )
        require(
            self.max_num_partial_prefills >= 1,
            f"max_num_partial_prefills must be >= 1, got {self.max_num_partial_prefills}",
        )
        require(
            1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills,
            f"max_long_partial_prefills must be in [1, max_num_partial_prefills="
            f"{self.max_num_partial_prefills}], got {self.max_long_partial_prefills}",
        )
