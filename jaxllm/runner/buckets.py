"""Static shapes the compiled step is built for.

A step's token count T is padded up to a bucket: powers of two, then linear steps of
``LINEAR_STEP``, up to ``max_num_batched_tokens``.  Each token bucket has one sequence
bucket, ``S = min(T, max_num_seqs)``: decode steps (S = T) waste nothing, and a prefill
only computes logits for a few padding rows more than it needs, which costs far less
than compiling (and, on every start, lowering) a second dimension of buckets.

S counts the step's sampling rows (a sequence is one row, except that a speculative
verification samples each of its k + 1 positions, spec_decode/), so with speculation on a request
can take up to 1 + k rows: token buckets that can hold more rows than ``max_num_seqs`` get a
second sequence bucket, ``S = min(T, max_num_seqs * (1 + k))``, picked only by steps that need
the rows, so a prefill step still computes logits for ``max_num_seqs`` rows at most.

Speculation also adds the token buckets ``b * (1 + k)`` for ``b`` = 1, 2, 4, ... up to
``max_num_seqs`` (below ``LINEAR_STEP``), as vLLM rounds its CUDA-graph sizes to multiples
of ``1 + k``: b requests verifying k proposals each fill such a step exactly, where the
next power of two would compute up to 60% padding rows (k = 4: 5 tokens in a bucket of 8)
on hardware where every row costs (a CPU at a few requests).

A pooling engine's steps are prefills only (``StepConfig.pooling_type``): its token buckets
start at ``POOLING_MIN_TOKENS`` (the encoder runner's rule, pooling/runner.py), since a batch
of a few short prompts padded to 16 tokens costs little more than its own tokens, and each
smaller bucket would be one more program to compile.
"""

from __future__ import annotations

import bisect

LINEAR_STEP = 256
POOLING_MIN_TOKENS = 16


def token_buckets(max_num_batched_tokens: int, min_tokens: int = 1) -> list[int]:
    """Powers of two from ``min_tokens`` (one), then linear steps, ``max_num_batched_tokens`` last."""
    out, b = [], min(min_tokens, max_num_batched_tokens)
    while b < max_num_batched_tokens and b < LINEAR_STEP:
        out.append(b)
        b *= 2
    b = LINEAR_STEP
    while b < max_num_batched_tokens:
        out.append(b)
        b += LINEAR_STEP
    out.append(max_num_batched_tokens)
    return sorted(set(out))


def verification_buckets(max_num_batched_tokens: int, max_num_seqs: int, k: int) -> list[int]:
    """The token buckets of b requests verifying k proposals each (b a power of two)."""
    out, b = [], 1
    while b <= max_num_seqs and b * (1 + k) < min(LINEAR_STEP, max_num_batched_tokens):
        out.append(b * (1 + k))
        b *= 2
    return out


def step_buckets(max_num_batched_tokens: int, max_num_seqs: int, max_rows: int | None = None,
                 num_speculative_tokens: int = 0, min_tokens: int = 1) -> list[tuple[int, int]]:
    """Every (T, S) shape compiled at start-up, sorted; ``max_rows``: the most sampling rows a
    step can have (``max_num_seqs`` when None: no speculation); ``num_speculative_tokens``:
    the k whose verification buckets are added; ``min_tokens``: the smallest token bucket
    (a power of two; ``POOLING_MIN_TOKENS`` for a pooling engine)."""
    out = set()
    tokens = set(token_buckets(max_num_batched_tokens, min_tokens))
    if num_speculative_tokens:
        tokens.update(verification_buckets(max_num_batched_tokens, max_num_seqs, num_speculative_tokens))
    for t in sorted(tokens):
        out.add((t, min(t, max_num_seqs)))
        if max_rows is not None:
            out.add((t, min(t, max_rows)))
    return sorted(out)


def pick(num_tokens: int, num_rows: int, buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """The smallest bucket (fewest tokens, then fewest rows) that holds ``num_tokens`` tokens
    in ``num_rows`` sampling rows; ``buckets`` sorted."""
    i = bisect.bisect_left(buckets, (num_tokens, 0))
    for b in buckets[i:]:
        if b[1] >= num_rows:
            return b
    raise ValueError(f"no step bucket holds {num_tokens} tokens in {num_rows} rows (largest: {buckets[-1]})")
