"""What happens to a pooled row on the host, after the compiled step: Matryoshka ``dimensions``
(cut an embedding to its first values, then normalize), and a classifier's logits as
probabilities with the checkpoint's labels.

Matryoshka support is read as vLLM reads it (``config.json``: ``is_matryoshka`` and / or
``matryoshka_dimensions``), plus sentence-transformers' saved ``truncate_dim``
(``config_sentence_transformers.json``), which is also the folder's default size.  The refusals
are vLLM's, each naming ``dimensions``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np


def _json(path: str) -> dict:
    try:
        with open(path) as f:
            out = json.load(f)
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


@dataclass(frozen=True)
class Matryoshka:
    """A checkpoint's Matryoshka declaration."""

    supported: bool = False
    dimensions: tuple[int, ...] | None = None
    """``matryoshka_dimensions``: the only sizes allowed, when the checkpoint lists them."""
    default: int | None = None
    """sentence-transformers' ``truncate_dim``: the size a request without ``dimensions`` gets."""

    @classmethod
    def read(cls, folder: str) -> "Matryoshka":
        hf = _json(os.path.join(folder, "config.json"))
        dims = hf.get("matryoshka_dimensions")
        dims = tuple(int(d) for d in dims) if isinstance(dims, list) and dims else None
        st = _json(os.path.join(folder, "config_sentence_transformers.json")).get("truncate_dim")
        default = int(st) if isinstance(st, int) and st > 0 else None
        return cls(supported=bool(dims) or hf.get("is_matryoshka") is True or default is not None,
                   dimensions=dims, default=default)

    def check(self, dimensions: int | None, hidden_size: int, model_name: str) -> None:
        """A ValueError (vLLM's words) when ``dimensions`` cannot be served by this model."""
        if dimensions is None:
            return
        if not self.supported:
            raise ValueError(f'Model "{model_name}" does not support matryoshka representation, changing output '
                             f"dimensions will lead to poor results (it declares no Matryoshka dimensions; its "
                             f"vectors have {hidden_size} dimensions)")
        if self.dimensions is not None:   # vLLM: the list decides; without one, any size from 1
            if dimensions not in self.dimensions:
                raise ValueError(f'Model "{model_name}" only supports {list(self.dimensions)} matryoshka dimensions, '
                                 f"use other output dimensions will lead to poor results (dimensions {dimensions})")
        elif dimensions < 1:
            raise ValueError(f"dimensions must be greater than 0, got {dimensions}")
        if dimensions > hidden_size:
            raise ValueError(f"dimensions {dimensions} is more than the model's {hidden_size} dimensions")


def truncate(vec: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """vec [D] (or ALL pooling's [n, D]) float32, already normalized when ``normalize`` -> [dimensions]
    ([n, dimensions]): the first values of each vector,
    normalized again after the cut (vLLM's and sentence-transformers' order: a positive scale
    does not change the direction, so cutting the normalized vector and normalizing gives the
    same as cutting the raw one)."""
    if dimensions is None or dimensions >= vec.shape[-1]:
        return vec
    out = vec[..., :dimensions]
    if normalize:   # torch's F.normalize: x / max(||x||, 1e-12)
        out = out / np.maximum(np.linalg.norm(out.astype(np.float64), axis=-1, keepdims=True), 1e-12)
    return out.astype(np.float32)


def read_labels(folder: str, num_labels: int) -> list[str]:
    """The classifier's label names (``config.json`` ``id2label``; ``LABEL_i`` where it names none)."""
    id2label = _json(os.path.join(folder, "config.json")).get("id2label") or {}
    return [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(num_labels)]


def predicted_label(probs: np.ndarray, labels: list[str]) -> str:
    """The likeliest class's name (vLLM's ``label`` in a ``/classify`` answer)."""
    return labels[int(np.argmax(probs))]


def class_probs(logits: np.ndarray) -> np.ndarray:
    """logits [L] -> probabilities [L] float32: the softmax, or for one label its sigmoid (vLLM's
    and sentence-transformers' rule for a one-label head)."""
    x = np.asarray(logits, np.float64)
    if x.shape[-1] == 1:
        p = 1.0 / (1.0 + np.exp(-x))
    else:
        e = np.exp(x - x.max(-1, keepdims=True))
        p = e / e.sum(-1, keepdims=True)
    return p.astype(np.float32)
