"""Kernels: the implementation each of the model's operations runs, one static object.

The engine core decides them once (``engine/resolve.py``) and refuses, naming
the flag, what cannot run on this platform, mesh or dtype; the model and its layers take
the decision as given.  Frozen and hashable: it is part of what identifies a compiled step.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kernels:
    matmul: str = "xla"
    """The linear maps: "xla" (dot_general) or "native" (the CPU kernel of ``jaxllm/cpu``)."""
    attention: str = "xla"
    """Paged attention: "xla", "pallas" or "native" (``layers.attention.attend``)."""
    moe: str = "grouped"
    """The experts of MoE checkpoints: "grouped", "dense" or "expert_parallel" (``layers/moe.py``)."""
