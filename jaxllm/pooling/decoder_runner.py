"""The pooling runner of a causal decoder (``--convert embed|classify``): its prompts are
prefill-only requests of a generation engine core (``engine/core.py``), so they take KV blocks
like any prompt, are chunked under ``max_num_batched_tokens`` (a prompt longer than a step
works), batch continuously with each other and run the engine's AOT-compiled step buckets on
its kernels (native CPU, XLA or Pallas attention).  The step of a pooling engine also returns
each sequence's pooled final-norm hidden state (``runner/step.pooled_rows``: LAST, the rows the
LM head reads; MEAN, summed over the chunks by the runner); the scheduler ends a request at its
last chunk with that row and frees its blocks at once.  The core schedules asynchronously by
default, as for generation (``async_scheduling``): a prompt's next chunk is dispatched while
its previous one runs.  Prefix caching is off (vLLM's rule for
pooling).  Here, on the host: the classifier head on the last token, or L2 normalization.

CLS pooling has no meaning for a causal decoder (its first token sees nothing after it) and is
refused.  No sampler runs after a pooling step (the runner compiles none, nor the async token
feed; its token buckets start at 16: ``runner/buckets.py``); the scheduler drops the
placeholder token each finished row gets.
"""

from __future__ import annotations

import itertools

import numpy as np

from jaxllm.config import CacheConfig, EngineConfig, RunnerConfig, SchedulerConfig
from jaxllm.engine.core import EngineCore
from jaxllm.models.loader import LoadedModel
from jaxllm.pooling.config import PoolerConfig
from jaxllm.request import Request
from jaxllm.sampling_params import SamplingParams

ATTENTION_BACKENDS = ("auto", "native", "xla", "pallas")


def check_attention_backend(asked: str) -> str:
    if asked not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend (--attention-backend) must be one of {', '.join(ATTENTION_BACKENDS)}, "
                         f"got {asked!r}")
    return asked


class DecoderPoolingRunner:
    """``run(prompts)`` -> one row per prompt: the pooled vector [D], or the classifier's logits
    [num_labels] (``head`` given)."""

    def __init__(self, loaded: LoadedModel, pooler: PoolerConfig, head: np.ndarray | None, *, attention_backend: str,
                 max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int,
                 strict_compile_guard: bool = False, show_progress: bool = True, async_scheduling: bool = True,
                 compile_cache_dir: str | None = None):
        if pooler.pooling_type not in ("LAST", "MEAN"):
            raise ValueError(f"--pooler-config pooling_type {pooler.pooling_type} is not for a causal decoder "
                             "(its first token sees nothing after it): use LAST or MEAN")
        self.pooler, self.head = pooler, head
        config = EngineConfig(
            model=loaded.name,
            cache=CacheConfig(enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len, async_scheduling=async_scheduling),
            # float32 as the oracles; buckets compiled when a step first needs them (compile_all: every one).
            runner=RunnerConfig(dtype="float32", attention_backend=check_attention_backend(attention_backend),
                                precompile="on-demand", strict_compile_guard=strict_compile_guard,
                                show_progress=show_progress, pooling_type=pooler.pooling_type,
                                compile_cache_dir=compile_cache_dir))
        self.core = EngineCore(config, loaded)
        step = self.core.resolved.step
        self.kernels, self.buckets = step.kernels, step.buckets
        self._ids = itertools.count()

    def compile_all(self) -> None:
        self.core.compile_all()

    def run(self, prompts: list[list[int]], token_types=None) -> list[np.ndarray]:
        """Checked token-id lists -> one float32 row each, in order (``token_types``: unused, a
        decoder has none)."""
        ids = [f"pool-{next(self._ids)}" for _ in prompts]
        for rid, p in zip(ids, prompts):
            self.core.add_request(Request(rid, p, SamplingParams(temperature=0.0, max_tokens=1), max_tokens=1,
                                          pooling=True))
        rows: dict[str, np.ndarray] = {}
        while len(rows) < len(ids):
            for o in self.core.step().outputs:
                if o.pooled is not None:
                    rows[o.request_id] = np.asarray(o.pooled, np.float32)          # [D]
        return [self._finish(rows[rid]) for rid in ids]

    def _finish(self, row: np.ndarray) -> np.ndarray:
        if self.head is not None:
            return (self.head @ row).astype(np.float32)                              # [labels]
        if self.pooler.normalize:   # torch's F.normalize: x / max(||x||, 1e-12)
            row = row / max(float(np.linalg.norm(row)), 1e-12)
        return row.astype(np.float32)
