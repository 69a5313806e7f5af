"""The shapes the engine compiles for, declared in one place.

Token buckets are 1 and 4 (small decode batches: on CPU a step's cost grows with its padded size,
so a single request must not pay for 16 rows), then powers of two from 16 up to
max_num_batched_tokens (which is included even when it is not a power of two). The sequence
dimension of a step is min(token bucket, max_num_seqs): a step never has more sequences than
tokens, so one compile per token bucket covers every batch.
"""

from __future__ import annotations

import bisect

SMALL_TOKEN_BUCKETS = (1, 4)
MIN_POWER_OF_TWO_BUCKET = 16


def make_token_buckets(max_num_batched_tokens: int, extra: tuple[int, ...] = ()) -> list[int]:
    """`extra`: more sizes (speculative decoding's 1 + k), kept when below max_num_batched_tokens."""
    buckets = list(SMALL_TOKEN_BUCKETS)
    size = MIN_POWER_OF_TWO_BUCKET
    while size < max_num_batched_tokens:
        buckets.append(size)
        size *= 2
    buckets.append(max_num_batched_tokens)
    return sorted(set(buckets) | {n for n in extra if n < max_num_batched_tokens})


def pick_bucket(buckets: list[int], num_tokens: int) -> int:
    """The smallest bucket holding `num_tokens`."""
    i = bisect.bisect_left(buckets, num_tokens)
    if i == len(buckets):
        raise ValueError(f"a step of {num_tokens} tokens exceeds max_num_batched_tokens={buckets[-1]}")
    return buckets[i]


def request_bucket(num_tokens_bucket: int, max_num_seqs: int) -> int:
    return min(num_tokens_bucket, max_num_seqs)
