"""The pooling runner: whole prompts packed into a flat ragged batch, padded to a token bucket,
run through the encoder and pooled by one compiled program per bucket.

Every prompt runs whole in one step (no chunking: a bidirectional encoder needs all of a prompt's
tokens at once), so nothing outlives a step: no KV cache, no prefix caching.  Buckets: token
counts ``T`` in powers of two from 16 up to ``max_num_batched_tokens`` (that value last), each
with ``S = min(T, max_num_seqs)`` prompt rows of at most ``max_model_len`` tokens.  Programs are
lowered from ``ShapeDtypeStruct``s and compiled ahead of time; a step never traces or compiles a
bucket already built.

Grid programs: a family whose encoder can run whole layers in a ``[rows, width]`` grid of its
prompts (BERT's rows layout, ``encoder_layout``) gets, beside each bucket's program from
``GRID_MIN_TOKENS`` tokens, one per grid width ``w`` (powers of two below ``max_model_len``, and
``max_model_len``) with ``T // w`` rows of at most ``w`` tokens.  A step whose prompts fit one
(no prompt longer than ``w``, no more prompts than rows) runs the narrowest that fits.  The
bucket's own program must take ``max_model_len``-token prompts, so its grid would be
``max_num_seqs x max_model_len`` cells, far more than ``T`` at a server's defaults, and it
attends over the whole step under a same-prompt mask instead: a 6-layer BERT at an engine's
defaults (``max_model_len`` 512, 1024-token steps) embedded 128-token texts at 21 a second that
way, 60 in 8 x 128 grids (docs/BENCHMARKS.md, ``## Embeddings``).  The same sums either way: a
vector does not depend on the program its step ran in beyond float32 rounding.
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


GRID_MIN_TOKENS = 256
"""The smallest bucket with grid programs: in a step of up to 128 tokens the bucket's own dense
attention is about 5% of a BERT layer's multiply-adds (128 x 128 scores per head against the
linear layers' 128 rows), not worth programs to compile."""


def token_buckets(max_num_batched_tokens: int) -> list[int]:
    """Powers of two from 16, then ``max_num_batched_tokens`` itself (also the grid widths up to
    ``max_model_len``)."""
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

        def step(params, input_ids, positions, seq_ids, token_types, query_start_loc, max_len):
            # max_len: no prompt is longer; rows (static): the step's prompt rows (the encoder may
            # lay its attention out by them).
            hidden = module.encode(arch, params, input_ids, positions, seq_ids, token_types,
                                   max_len or max_model_len, query_start_loc.shape[0] - 1)   # [T, D]
            if classifier:
                return module.classify(arch, params, hidden, seq_ids, query_start_loc)       # [S, labels]
            return pool(pooler, hidden, seq_ids, query_start_loc)                             # [S, D]
        # max_len (static): no prompt of the step is longer; None: max_model_len (a bucket's own
        # program), else a grid width.
        self._step = jax.jit(step, static_argnums=6)
        self._compiled: dict[tuple[int, int | None], object] = {}
        # Per bucket, the widths of at least two rows whose grid program is not the bucket's own.
        layout = getattr(module, "encoder_layout", None)
        self.grid_widths = {T: [w for w in token_buckets(max_model_len or T)
                                if layout is not None and T >= GRID_MIN_TOKENS and T // w >= 2
                                and layout(T, T // w, w) == "rows"
                                and (T // w, w) != (self.bucket_rows(T), max_model_len)]
                            for T in self.buckets}

    def bucket_rows(self, T: int, width: int | None = None) -> int:
        """Prompt rows of bucket ``T``'s program (of its grid program of ``width``)."""
        return T // width if width else min(T, self.max_num_seqs)

    def grid_width(self, T: int, prompts: int, longest: int) -> int | None:
        """The narrowest grid width of bucket ``T`` that holds ``prompts`` prompts of at most
        ``longest`` tokens; None: the bucket's own program runs the step."""
        return next((w for w in self.grid_widths[T] if longest <= w and prompts <= T // w), None)

    def compile(self, T: int, width: int | None = None):
        """The program of token bucket ``T`` (``width``: its grid program of that width), built
        once, from shapes only."""
        exe = self._compiled.get((T, width))
        if exe is None:
            params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self.params)
            exe = self._step.lower(params, *self._shapes(T, width), width).compile()
            self._compiled[(T, width)] = exe
            log.debug("pooling bucket T=%d S=%d width %s compiled", T, self.bucket_rows(T, width), width)
        return exe

    def _shapes(self, T: int, width: int | None = None) -> list:
        """The step's array arguments of bucket ``T`` (after the params), as shapes."""
        i32 = jnp.int32
        return [jax.ShapeDtypeStruct((T,), i32)] * 4 + [jax.ShapeDtypeStruct((self.bucket_rows(T, width) + 1,), i32)]

    def _args(self, chunk: list[list[int]], types: list[list[int]] | None, T: int, width: int | None = None) -> tuple:
        """The step's array arguments for the prompts ``chunk`` in bucket ``T`` (its grid program of ``width``)."""
        packed = pack(chunk, types, T, self.bucket_rows(T, width))
        return (packed.input_ids, packed.positions, packed.seq_ids, packed.token_types, packed.query_start_loc)

    def compile_all(self) -> None:
        for T in self.buckets:
            self.compile(T)
            for w in self.grid_widths[T]:
                self.compile(T, w)

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
            width = self.grid_width(T, len(chunk), max(len(p) for p in chunk))
            exe = self.compile(T, width)
            args = self._args(chunk, types, T, width)
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
