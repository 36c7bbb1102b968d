"""Which GGUF projections meet int8-rounded activations: ``--cpu-matmul``'s per-projection choice.

``native-int8`` rounds the input of every Q8_0/Q4_*/Q5_* projection to int8 per 32 values
(``cpu/quant_dot.cc``); ``native`` keeps float32 activations everywhere (``cpu/quant_linear.cc``,
about 4x slower at batch 32); ``auto`` (the mixed scheme) rounds all but the projections
whose input the rounding hurts most, measured per projection kind on the built-in model
(docs/BENCHMARKS.md, "Perplexity"): those take the int8 kernel twice, on the rounded input
and on its remainder (``native_matmul.linear_packed_split``), about float32's accuracy at
half its cost at batch 32.

The choice is recorded on each weight (``PackedWeight.activations``, static: part of the
compiled step's identity) by parameter name, never by the step's shape, so a token's
logits stay the same bits whatever batch or chunk it runs in.
"""

from __future__ import annotations

import dataclasses

from jaxllm.quant.gguf_blocks import PackedWeight

MIXED = {"down": "split"}
"""``auto``'s exceptions: parameter (``models/*/params.py`` name) -> ``PackedWeight.activations``."""


def mark(tensors: dict[str, object], mixed: bool) -> None:
    """Sets, in place, ``activations`` on each GGUF weight of ``tensors`` (one layer's or the
    globals, by parameter name): :data:`MIXED`'s choice when ``mixed``, else "" (every weight
    as its backend says)."""
    for name, w in tensors.items():
        if isinstance(w, PackedWeight):
            want = MIXED.get(name, "") if mixed else ""
            if w.activations != want:
                tensors[name] = dataclasses.replace(w, activations=want)
