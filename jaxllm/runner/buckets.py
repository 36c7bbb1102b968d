"""Static shapes the compiled step is built for.

A step's token count T is padded up to a bucket: powers of two, then linear steps of
``LINEAR_STEP``, up to ``max_num_batched_tokens``.  Each token bucket has one sequence
bucket, ``S = min(T, max_num_seqs)``: decode steps (S = T) waste nothing, and a prefill
only computes logits for a few padding rows more than it needs, which costs far less
than compiling (and, on every start, lowering) a second dimension of buckets.
"""

from __future__ import annotations

import bisect

LINEAR_STEP = 256


def token_buckets(max_num_batched_tokens: int) -> list[int]:
    out, b = [], 1
    while b < max_num_batched_tokens and b < LINEAR_STEP:
        out.append(b)
        b *= 2
    b = LINEAR_STEP
    while b < max_num_batched_tokens:
        out.append(b)
        b += LINEAR_STEP
    out.append(max_num_batched_tokens)
    return sorted(set(out))


def step_buckets(max_num_batched_tokens: int, max_num_seqs: int) -> list[tuple[int, int]]:
    """Every (T, S) shape compiled at start-up."""
    return [(t, min(t, max_num_seqs)) for t in token_buckets(max_num_batched_tokens)]


def pick(num_tokens: int, num_seqs: int, buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """The smallest bucket that holds ``num_tokens`` tokens of ``num_seqs`` sequences."""
    i = bisect.bisect_left([t for t, _ in buckets], num_tokens)
    if i == len(buckets) or buckets[i][1] < num_seqs:
        raise ValueError(f"no step bucket holds {num_tokens} tokens of {num_seqs} sequences "
                         f"(largest: {buckets[-1]})")
    return buckets[i]
