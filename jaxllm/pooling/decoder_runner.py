"""The pooling runner of a causal decoder (``--convert embed|classify``): the family's own
``forward`` (native CPU, XLA or Pallas attention: the kernels generation runs) over whole prompts
packed into a token bucket, each prefilled from position 0 into fresh pages of a scratch KV cache
that the compiled step allocates and drops (nothing kept after it, no prefix caching); the
final-norm hidden states are pooled (LAST by default) or the last token's go through the
classifier head.  ``compute_logits`` is never called.

Buckets, planning and the compile guard are the encoder runner's (``runner.py``): programs are
lowered from ``ShapeDtypeStruct``s ahead of time, one per token bucket.
"""

from __future__ import annotations

import logging
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.cpu import native as cpu_native
from jaxllm.layers.attention import AttentionMetadata
from jaxllm.models.kernels import Kernels
from jaxllm.models.loader import LoadedModel
from jaxllm.pooling.config import PoolerConfig
from jaxllm.pooling.pool import pool
from jaxllm.pooling.runner import PoolingRunner, pack, token_buckets
from jaxllm.runner import weights

log = logging.getLogger("jaxllm.engine")

BLOCK_SIZE = 16
ATTENTION_BACKENDS = ("auto", "native", "xla", "pallas")


def pick_kernels(asked: str) -> Kernels:
    """``attention_backend`` -> the step's kernels: auto is Pallas on a GPU, the native CPU
    kernels (matmul and attention) on a CPU where they build, else XLA."""
    if asked not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend (--attention-backend) must be one of {', '.join(ATTENTION_BACKENDS)}, "
                         f"got {asked!r}")
    platform = jax.default_backend()
    if asked == "auto":
        asked = "pallas" if platform in ("gpu", "cuda", "rocm") else (
            "native" if platform == "cpu" and cpu_native.available() else "xla")
    if asked == "native":
        if platform != "cpu" or not cpu_native.available():
            raise ValueError("--attention-backend native is the CPU kernel, unavailable here; use xla or pallas")
        return Kernels(matmul="native", attention="native")
    return Kernels(matmul="xla", attention=asked)


def block_count(T: int, S: int) -> tuple[int, int]:
    """(pages in the scratch cache, pages per row) for bucket (T, S): the null page 0, then at
    most ``ceil(T / BLOCK_SIZE) + S`` pages for the rows (each row's last page partly filled)."""
    per_row = -(-T // BLOCK_SIZE)
    return 1 + per_row + S, per_row


def attention_inputs(prompts: list[list[int]], T: int, S: int) -> tuple[np.ndarray, ...]:
    """slot_mapping [T], token_seq [T], block_tables [S, max_blocks], seq_lens [S] of the packed
    prompts, each in fresh pages from page 1 (padding tokens write into the null page 0)."""
    _, per_row = block_count(T, S)
    slots = np.zeros(T, np.int32)
    token_seq = np.zeros(T, np.int32)
    tables = np.zeros((S, per_row), np.int32)
    seq_lens = np.zeros(S, np.int32)
    at, page = 0, 1
    for row, p in enumerate(prompts):
        n = len(p)
        pages = -(-n // BLOCK_SIZE)
        tables[row, :pages] = np.arange(page, page + pages, dtype=np.int32)
        pos = np.arange(n, dtype=np.int32)
        slots[at:at + n] = tables[row, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        token_seq[at:at + n] = row
        seq_lens[row] = n
        at += n
        page += pages
    return slots, token_seq, tables, seq_lens


class DecoderPoolingRunner(PoolingRunner):
    """One row per prompt: the pooled vector [D], or the classifier's logits [num_labels]
    (``head`` given)."""

    def __init__(self, loaded: LoadedModel, module: ModuleType, pooler: PoolerConfig, head: np.ndarray | None, *,
                 kernels: Kernels, max_num_batched_tokens: int, max_num_seqs: int,
                 strict_compile_guard: bool = False):
        arch = loaded.arch
        self.arch, self.pooler, self.kernels = arch, pooler, kernels
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.strict = strict_compile_guard
        self.per_token = False   # pooling_type ALL is refused for a converted decoder at start-up
        self.buckets = token_buckets(max_num_batched_tokens)
        native = kernels.matmul == "native"
        # float32, unrolled layers (the native kernels' layout when they run); the head beside them.
        model = weights.host_params(loaded, jnp.float32, scan_layers=False, packed_bf16=False, native=native)
        self.params = jax.tree.map(jnp.asarray, {"model": model, **({} if head is None else {"head": head})})
        L, Hkv, Dh = arch.num_layers, arch.num_kv_heads, arch.head_dim

        def step(params, input_ids, positions, seq_ids, slot_mapping, token_seq, block_tables, seq_lens,
                 query_start_loc):
            T, S = input_ids.shape[0], seq_lens.shape[0]
            nb, _ = block_count(T, S)
            # The scratch cache: written by this step's prefill, read by its attention, dropped after.
            kv = tuple([jnp.zeros((nb, BLOCK_SIZE, Hkv, Dh), jnp.float32) for _ in range(L)] for _ in range(2))
            md = AttentionMetadata(positions=positions, slot_mapping=slot_mapping, token_seq=token_seq,
                                   block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc)
            hidden, _ = module.forward(arch, params["model"], kv, input_ids, md, kernels)   # [T, D]
            hidden = hidden.astype(jnp.float32)
            if head is not None:
                last = hidden[jnp.maximum(query_start_loc[1:] - 1, 0)]                      # [S, D]
                return jax.lax.dot_general(last, params["head"], (((1,), (1,)), ((), ())),
                                           precision=jax.lax.Precision.HIGHEST,
                                           preferred_element_type=jnp.float32)              # [S, labels]
            return pool(pooler, hidden, seq_ids, query_start_loc)                           # [S, D]
        self._step = jax.jit(step)
        self._compiled: dict[int, object] = {}

    def _shapes(self, T: int) -> list:
        S = self.bucket_rows(T)
        _, per_row = block_count(T, S)
        i32 = jnp.int32
        return ([jax.ShapeDtypeStruct((T,), i32)] * 5 + [jax.ShapeDtypeStruct((S, per_row), i32),
                                                         jax.ShapeDtypeStruct((S,), i32),
                                                         jax.ShapeDtypeStruct((S + 1,), i32)])

    def _args(self, chunk: list[list[int]], types, T: int) -> tuple:
        S = self.bucket_rows(T)
        packed = pack(chunk, None, T, S)
        slots, token_seq, tables, seq_lens = attention_inputs(chunk, T, S)
        return (packed.input_ids, packed.positions, packed.seq_ids, slots, token_seq, tables, seq_lens,
                packed.query_start_loc)
