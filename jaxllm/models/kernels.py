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
    """The linear maps: "xla" (dot_general), "native" (the CPU kernel of ``jaxllm/cpu``) or
    "pallas" (quantized int / fp8 weights through ``pallas/quant_matmul.py``; a GPU's choice)."""
    attention: str = "xla"
    """Paged attention: "xla", "pallas" or "native" (``layers.attention.attend``)."""
    moe: str = "grouped"
    """The experts of MoE checkpoints: "grouped", "dense" or "expert_parallel" (``layers/moe.py``)."""
    int8_activations: bool = False
    """With the native matmul: GGUF blocks are multiplied by activations rounded to int8 per
    32 values (``cpu/quant_dot.cc``) instead of float32 ones (``--cpu-matmul native-int8``)."""
    int16_activations: bool = False
    """With the native matmul: Q4_1 blocks (and Q8_0 ones where the CPU has AVX-512 VNNI) are
    multiplied by activations rounded to int16 per 32 values (``cpu/quant_dot.cc``), the other
    types by float32 ones (``--cpu-matmul native-int16``)."""

    @property
    def linear(self) -> str:
        """The ``backend`` of ``layers/linear.py`` the model's linear maps take."""
        if self.matmul == "native" and self.int8_activations:
            return "native-int8"
        if self.matmul == "native" and self.int16_activations:
            return "native-int16"
        return self.matmul
