"""The LoRA delta a layer adds to a projection's output, per token, inside the compiled step.

Every slot's shrink is computed and the token's own slot kept by a one-hot mask
(``einsum(x, one_hot(slot), A)``, as tpu-inference and sglang-jax do): measured on this CPU
for max_loras=4, T=32, in=out=576, R=16, 107-150 us a projection against 230-520 us for a
per-token gather of the ``[in, R]`` and ``[R, out]`` matrices (the gather copies T of them).
A token with slot -1 (the base model, or bucket padding) gets a zero one-hot row: no delta.
The delta is float32 (on the native CPU path the activations are float32 already).

When the step runs the GPU path (``Kernels.attention`` or ``Kernels.matmul`` "pallas"), the
delta is the Pallas kernel of ``pallas/lora.py`` instead (per token, only its own slot's
matrices are read); on CPU the one-hot einsum stays, measured faster here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from jaxllm.pallas.lora import lora_delta


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LoRAStep:
    """The step's adapters: the slot arrays and each token's slot."""

    weights: dict
    """param -> (A [max_loras, L, in, R], B [max_loras, L, R, out]) float32, scale folded into B."""
    slots: jax.Array
    """[T] int32, each token's slot (-1: none)."""
    kernel: str = field(default="einsum", metadata=dict(static=True))
    """"einsum" (the one-hot shrink and expand) or "pallas" (``pallas/lora.py``)."""


def kernel_for(kernels) -> str:
    """The delta's implementation for a step run with ``kernels`` (models/kernels.py)."""
    return "pallas" if "pallas" in (kernels.attention, kernels.matmul) else "einsum"


def delta(lora: LoRAStep | None, name: str, x: jax.Array, layer) -> jax.Array | None:
    """x [T, in] -> the delta [T, out] float32 of projection ``name`` at ``layer`` (an int, or a
    traced index under ``lax.scan``); None when no adapter can change it."""
    if lora is None or name not in lora.weights:
        return None
    A, B = lora.weights[name]
    A_l, B_l = A[:, layer], B[:, layer]                                  # [S, in, R], [S, R, out]
    if lora.kernel == "pallas":
        return lora_delta(x, A_l, B_l, lora.slots)                       # [T, out]
    onehot = jax.nn.one_hot(lora.slots, A.shape[0], dtype=jnp.float32)   # [T, S]
    xa = jnp.einsum("ti,sir->tsr", x.astype(jnp.float32), A_l) * onehot[:, :, None]   # [T, S, R]
    return jnp.einsum("tsr,sro->to", xa, B_l)                            # [T, out]


def add(y: jax.Array, lora: LoRAStep | None, name: str, x: jax.Array, layer) -> jax.Array:
    """``y`` (the projection of ``x``) plus its LoRA delta, in ``y``'s dtype."""
    d = delta(lora, name, x, layer)
    return y if d is None else (y.astype(jnp.float32) + d).astype(y.dtype)


def add_fused(y: jax.Array, lora: LoRAStep | None, names: tuple[str, ...], x: jax.Array, layer) -> jax.Array:
    """``y``: a fused projection (the parts' outputs concatenated in ``names``' order) plus each
    part's delta.  The slot arrays hold every target the model has (lora/targets.py), so a
    part no adapter changes adds zeros."""
    if lora is None:
        return y
    deltas = [delta(lora, n, x, layer) for n in names]                   # [T, out_i] each
    return (y.astype(jnp.float32) + jnp.concatenate(deltas, axis=-1)).astype(y.dtype)
