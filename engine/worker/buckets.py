"""The shapes the engine compiles for, declared in one place.

Token buckets are 1 and 4 (small decode batches: on CPU a step's cost grows with its padded size,
so a single request must not pay for 16 rows), then powers of two from 16 up to
max_num_batched_tokens (which is included even when it is not a power of two). The sequence
dimension of a step is min(token bucket, max_num_seqs): a step never has more sequences than
tokens, so one compile per token bucket covers every batch. Speculative decoding's extra bucket of
1 + k tokens (a lone request verifying k drafts) has one sequence row: it shares the lone request's
sampler and verify programs instead of compiling 4 + 4 of its own (a step of more requests takes the
next bucket). `cudagraph_capture_sizes` (vLLM's name) replaces these buckets by the ones chosen.
"""

from __future__ import annotations

import bisect

SMALL_TOKEN_BUCKETS = (1, 4)
MIN_POWER_OF_TWO_BUCKET = 16


def make_token_buckets(
    max_num_batched_tokens: int, extra: tuple[int, ...] = (), sizes: tuple[int, ...] | None = None
) -> list[int]:
    """`extra`: more sizes (speculative decoding's 1 + k), kept when below max_num_batched_tokens.
    `sizes`: the buckets chosen instead of the default ones (cudagraph_capture_sizes)."""
    if sizes is None:
        buckets = list(SMALL_TOKEN_BUCKETS)
        size = MIN_POWER_OF_TWO_BUCKET
        while size < max_num_batched_tokens:
            buckets.append(size)
            size *= 2
    else:
        buckets = list(sizes)
    buckets.append(max_num_batched_tokens)
    return sorted({n for n in (*buckets, *extra) if n <= max_num_batched_tokens})


def pick_bucket(buckets: list[int], num_tokens: int, num_seqs: int = 1, rows_for=None) -> int:
    """The smallest bucket holding `num_tokens` whose rows (`rows_for(bucket)`) hold `num_seqs`."""
    i = bisect.bisect_left(buckets, num_tokens)
    while rows_for is not None and i < len(buckets) and rows_for(buckets[i]) < num_seqs:
        i += 1
    if i == len(buckets):
        raise ValueError(f"a step of {num_tokens} tokens exceeds max_num_batched_tokens={buckets[-1]}")
    return buckets[i]


def request_bucket(num_tokens_bucket: int, max_num_seqs: int, lone_buckets: tuple[int, ...] = ()) -> int:
    """A token bucket's sequence rows; 1 for one of `lone_buckets` (speculative decoding's 1 + k)."""
    return 1 if num_tokens_bucket in lone_buckets else min(num_tokens_bucket, max_num_seqs)
