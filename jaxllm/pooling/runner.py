"""The pooling runner: whole prompts packed into a flat ragged batch, padded to a token bucket,
run through the encoder and pooled by one compiled program per bucket.

Every prompt runs whole in one step (no chunking: a bidirectional encoder needs all of a prompt's
tokens at once), so nothing outlives a step: no KV cache, no prefix caching.  Buckets: token
counts ``T`` in powers of two from 16 up to ``max_num_batched_tokens`` (that value last), each
with ``S = min(T, max_num_seqs)`` prompt rows.  Programs are lowered from ``ShapeDtypeStruct``s
and compiled ahead of time; a step never traces or compiles a bucket already built.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.models.config import ArchConfig
from jaxllm.pooling.config import PoolerConfig
from jaxllm.pooling.pool import pool

log = logging.getLogger("jaxllm.engine")

MIN_BUCKET = 16


def token_buckets(max_num_batched_tokens: int) -> list[int]:
    """Powers of two from 16, then ``max_num_batched_tokens`` itself."""
    out, t = [], MIN_BUCKET
    while t < max_num_batched_tokens:
        out.append(t)
        t *= 2
    return out + [max_num_batched_tokens]


@dataclass(frozen=True)
class PackedStep:
    """One step's host arrays, padded to the bucket (T, S)."""

    input_ids: np.ndarray        # [T] int32
    positions: np.ndarray        # [T] int32, each token's index in its prompt
    seq_ids: np.ndarray          # [T] int32, each token's prompt row; -1: padding
    token_types: np.ndarray      # [T] int32, 0 for a single text; a pair's second text 1
    query_start_loc: np.ndarray  # [S+1] int32; padding rows start and end at the last real token


def pack(prompts: list[list[int]], types: list[list[int]] | None, T: int, S: int) -> PackedStep:
    ids = np.zeros(T, np.int32)
    pos = np.zeros(T, np.int32)
    seq = np.full(T, -1, np.int32)
    tt = np.zeros(T, np.int32)
    qsl = np.zeros(S + 1, np.int32)
    at = 0
    for row, p in enumerate(prompts):
        n = len(p)
        ids[at:at + n] = p
        pos[at:at + n] = np.arange(n, dtype=np.int32)
        seq[at:at + n] = row
        if types is not None:
            tt[at:at + n] = types[row]
        at += n
        qsl[row + 1] = at
    qsl[len(prompts) + 1:] = at
    return PackedStep(ids, pos, seq, tt, qsl)


class PoolingRunner:
    """Holds the encoder's weights on the device and one compiled program per bucket.  A step
    returns one row per prompt: the pooled vector [D] of an embedder (with ALL pooling: its tokens'
    vectors [n, D]), or a cross-encoder's classifier logits [num_labels] (``arch.encoder.num_labels > 0``)."""

    def __init__(self, arch: ArchConfig, module: ModuleType, params: dict, pooler: PoolerConfig, *,
                 max_num_batched_tokens: int, max_num_seqs: int, strict_compile_guard: bool = False,
                 max_model_len: int | None = None):
        self.arch, self.pooler = arch, pooler
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.strict = strict_compile_guard
        self.buckets = token_buckets(max_num_batched_tokens)
        # float32 on the device; every weight of an encoder is read once per step.  A family may
        # lay its weights out for its forward first (BERT: q, k, v stacked).
        prepare = getattr(module, "prepare", None)
        if prepare is not None:
            params = prepare(params)
        self.params = jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float32)), params)

        classifier = arch.encoder.num_labels > 0
        self.per_token = pooler.pooling_type == "ALL" and not classifier

        def step(params, input_ids, positions, seq_ids, token_types, query_start_loc):
            # max_model_len: no prompt is longer; rows (static): the step's prompt rows (the
            # encoder may lay its attention out by them).
            hidden = module.encode(arch, params, input_ids, positions, seq_ids, token_types,
                                   max_model_len, query_start_loc.shape[0] - 1)               # [T, D]
            if classifier:
                return module.classify(arch, params, hidden, seq_ids, query_start_loc)       # [S, labels]
            return pool(pooler, hidden, seq_ids, query_start_loc)                             # [S, D]
        self._step = jax.jit(step)
        self._compiled: dict[int, object] = {}

    def bucket_rows(self, T: int) -> int:
        return min(T, self.max_num_seqs)

    def compile(self, T: int):
        """The program of token bucket ``T`` (built once, from shapes only)."""
        exe = self._compiled.get(T)
        if exe is None:
            params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self.params)
            exe = self._compiled[T] = self._step.lower(params, *self._shapes(T)).compile()
            log.debug("pooling bucket T=%d S=%d compiled", T, self.bucket_rows(T))
        return exe

    def _shapes(self, T: int) -> list:
        """The step's array arguments of bucket ``T`` (after the params), as shapes."""
        i32 = jnp.int32
        return [jax.ShapeDtypeStruct((T,), i32)] * 4 + [jax.ShapeDtypeStruct((self.bucket_rows(T) + 1,), i32)]

    def _args(self, chunk: list[list[int]], types: list[list[int]] | None, T: int) -> tuple:
        """The step's array arguments for the prompts ``chunk`` in bucket ``T``."""
        packed = pack(chunk, types, T, self.bucket_rows(T))
        return (packed.input_ids, packed.positions, packed.seq_ids, packed.token_types, packed.query_start_loc)

    def compile_all(self) -> None:
        for T in self.buckets:
            self.compile(T)

    def plan(self, lengths: list[int]) -> list[list[int]]:
        """Indices of the prompts each step runs, in order: as many as fit the token budget and
        ``max_num_seqs`` (every prompt is at most ``max_num_batched_tokens`` long)."""
        steps, cur, used = [], [], 0
        for i, n in enumerate(lengths):
            if cur and (used + n > self.max_num_batched_tokens or len(cur) == self.max_num_seqs):
                steps.append(cur)
                cur, used = [], 0
            cur.append(i)
            used += n
        if cur:
            steps.append(cur)
        return steps

    def run(self, prompts: list[list[int]], token_types: list[list[int]] | None = None) -> list[np.ndarray]:
        """One row float32 per prompt, in order (``token_types``: per prompt, for text pairs)."""
        out: list[np.ndarray | None] = [None] * len(prompts)
        for idx in self.plan([len(p) for p in prompts]):
            chunk = [prompts[i] for i in idx]
            types = None if token_types is None else [token_types[i] for i in idx]
            total = sum(len(p) for p in chunk)
            T = next(t for t in self.buckets if t >= total)
            exe = self.compile(T)
            args = self._args(chunk, types, T)
            if self.strict:
                with jax.no_tracing(True):
                    pooled = exe(self.params, *args)
            else:
                pooled = exe(self.params, *args)
            pooled = np.asarray(pooled)                               # [S, D]; ALL: [T, D]
            qsl = args[4]
            for row, i in enumerate(idx):
                out[i] = pooled[qsl[row]:qsl[row + 1]] if self.per_token else pooled[row]
        return out
