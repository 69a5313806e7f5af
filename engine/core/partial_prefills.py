"""Partial prefills: the prompts whose prefill spans steps, and vLLM's limits on them.

So that one long prompt cannot hold the others hostage, a prefill chunk is capped at
`long_prefill_token_threshold` tokens and only `max_num_partial_prefills` prompts (of which
`max_long_partial_prefills` long ones) are prefilled across steps at once: the rest of each step's
budget stays free for decodes and for short prompts, which then start within a step or two. The default
cap (`spares_budget`) is that fairness and no more: a prefill also takes what the step's other requests
will not (`reserve`: their tokens under the cap), so a prompt alone, or beside decodes, is not held to a
quarter of a step while the rest of it runs empty.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PartialPrefills:
    """One step's prompts whose prefill spans steps, and vLLM's limits on them.

    A request missing more tokens than its chunk this step is a partial prefill (a decode, or a
    prompt that fits whole, never is); a long one is missing more than `threshold` tokens.
    """

    max_num: int
    max_long: int
    threshold: int  # 0: chunks are not capped and no prompt counts as long
    spares_budget: bool = False  # the default threshold: a chunk may pass it into the budget others leave
    # No chunks (an encoder-only model, whose tokens attend to later ones): all missing tokens, or none.
    is_whole: bool = False
    num: int = 0
    num_long: int = 0

    def chunk(self, num_missing: int, token_budget: int, reserve: int = 0) -> int:
        """Tokens to schedule for a request missing `num_missing`; 0 when it must wait this step.
        `reserve`: the tokens the step's requests after this one take under the cap."""
        if self.is_whole:
            return num_missing if num_missing <= token_budget else 0
        num_new_tokens = min(num_missing, token_budget)
        if self.threshold:
            spare = token_budget - reserve if self.spares_budget else 0
            num_new_tokens = min(num_new_tokens, max(self.threshold, spare))
        if num_new_tokens == num_missing:
            return num_new_tokens
        if self.num >= self.max_num or (self._is_long(num_missing) and self.num_long >= self.max_long):
            return 0
        return num_new_tokens

    def add(self, num_missing: int, num_new_tokens: int) -> None:
        """Count a scheduled request."""
        if num_new_tokens < num_missing:
            self.num += 1
            self.num_long += self._is_long(num_missing)

    def _is_long(self, num_missing: int) -> bool:
        return 0 < self.threshold < num_missing


class Demands:
    """The tokens each request a step may schedule would take under the cap (a decode: 1 + its drafts; a
    prompt: min(missing, threshold)), in the order they are scheduled; `after(request_id)` drops that
    request's and returns what the rest take: a prefill's `reserve`. Empty where no chunk spares budget."""

    def __init__(self, demands: dict[str, int] | None = None):
        self.left = demands or {}
        self.total = sum(self.left.values())

    def after(self, request_id: str) -> int:
        self.total -= self.left.pop(request_id, 0)
        return self.total
