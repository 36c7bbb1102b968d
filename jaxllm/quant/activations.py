"""``--cpu-matmul native-int8-split``: GGUF projections through the int8-activation kernel twice.

``native-int8`` rounds the input of every Q8_0/Q4_*/Q5_* projection to int8 per 32 values
(``cpu/quant_dot.cc``): 1.2% worse perplexity than float32 activations on the built-in model.
``native-int8-split`` runs that kernel on the rounded input and on its remainder
(``native_matmul.linear_packed_split``): the remainder's own rounding error is about 1/254 of
int8's, so the products are close to float32 activations'.  Both halves run as one call of
2M rows (the weights read once): at batch 1 about an int8 call's time.  Measured per projection kind and in all on the built-in model:
docs/BENCHMARKS.md, "Perplexity".

The choice is recorded on each weight (``PackedWeight.activations``, static: part of the
compiled step's identity), never by the step's shape, so a token's logits stay the same bits
whatever batch or chunk it runs in.
"""

from __future__ import annotations

import dataclasses

from jaxllm.quant.gguf_blocks import PackedWeight


def mark(tensors: dict[str, object], split: bool) -> None:
    """Sets, in place, ``activations`` on each GGUF weight of ``tensors`` (one layer's or the
    globals): "split" when ``split``, else "" (the backend's int8 or float32 activations)."""
    want = "split" if split else ""
    for name, w in tensors.items():
        if isinstance(w, PackedWeight) and w.activations != want:
            tensors[name] = dataclasses.replace(w, activations=want)
