"""What a pooling request returns, shaped as vLLM's: ``EmbeddingRequestOutput.outputs.embedding``,
``ScoringRequestOutput.outputs.score``, ``ClassificationRequestOutput.outputs.probs``,
``PoolingRequestOutput.outputs.data``."""

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


@dataclass(frozen=True)
class ClassificationOutput:
    probs: list[float]
    """The classifier's probabilities: the softmax of its logits (one label: the sigmoid)."""

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(frozen=True)
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass(frozen=True)
class PoolingOutput:
    data: list[float] | list[list[float]]
    """What the model's pooler gives: an embedder's vector (as ``embed``), with ``pooling_type`` ALL
    one vector per prompt token ([n][D]), a classifier's probabilities."""


@dataclass(frozen=True)
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
