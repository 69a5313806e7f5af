"""What a request may ask for, checked in one place with one rule: by the front end before a
request is admitted (so a user gets a 400 naming the field) and by the scheduler (so nothing that
reaches it can hang waiting for room that will never exist)."""

from __future__ import annotations

from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_prompt_length(num_prompt_tokens: int, max_model_len: int) -> None:
    """The prompt must leave room for at least one output token (the front end's and the
    scheduler's rule, written once)."""
    if num_prompt_tokens >= max_model_len:
        raise ValueError(
            f"prompt (length {num_prompt_tokens} tokens) is too long: it must be shorter than "
            f"max_model_len={max_model_len} to leave room for at least one output token"
        )


@dataclass(frozen=True)
class RequestLimits:
    max_model_len: int  # prompt + output tokens of one sequence
    block_size: int
    num_usable_blocks: int  # KV cache blocks a request may hold (the null block excluded)

    def check(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """ValueError, naming the field first, if a request can never run to its end.

        The prompt must leave room for one output token; the blocks of its longest possible
        sequence, min(prompt + max_tokens, max_model_len) tokens, must fit in the cache.
        `max_tokens=None` means "as many as max_model_len allows".
        """
        check_prompt_length(num_prompt_tokens, self.max_model_len)
        room = self.max_model_len - num_prompt_tokens
        num_tokens = num_prompt_tokens + (room if max_tokens is None else min(max_tokens, room))
        num_blocks = cdiv(num_tokens, self.block_size)
        if num_blocks > self.num_usable_blocks:
            raise ValueError(
                f"max_tokens: the request needs {num_blocks} KV cache blocks for {num_tokens} tokens, "
                f"but the cache has only {self.num_usable_blocks}; reduce the prompt or max_tokens"
            )
