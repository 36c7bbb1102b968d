"""vLLM's ``PoolingParams``: per-request options of the pooling runner's outputs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolingParams:
    dimensions: int | None = None
    """A Matryoshka model's output size: the embedding's first ``dimensions`` values (normalized
    after the cut when the pooler normalizes); None: the model's default (all, or
    ``--pooler-config`` / sentence-transformers' ``truncate_dim``).  A model without Matryoshka
    support refuses it (ValueError naming ``dimensions``)."""

    def __post_init__(self):
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)):
            raise ValueError(f"dimensions must be an integer, got {self.dimensions!r}")
