"""What a pooling request returns, shaped as vLLM's: ``EmbeddingRequestOutput.outputs.embedding``,
``ScoringRequestOutput.outputs.score``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EmbeddingOutput:
    embedding: list[float]
    """The pooled (and, with ``normalize``, L2-normalized) vector."""

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(frozen=True)
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass(frozen=True)
class ScoringOutput:
    score: float
    """A cross-encoder's relevance (the sigmoid of its one logit), or an embedder's cosine similarity."""


@dataclass(frozen=True)
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
