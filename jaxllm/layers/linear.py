"""Linear maps over weights stored as transformers stores them: ``[out, in]``.

The contraction is ``x @ w.T`` written as a dot_general on the last axes of both, which
XLA's CPU runtime runs without materialising a transpose, and with float32 accumulation
so a bf16 weight is never upcast as a whole (DESIGN.md, "bf16 on XLA CPU").  On CPU the
native kernel (``jaxllm/cpu``) replaces XLA's dot when available: same function, faster
for decode-sized batches and for bf16 weights.  A quantized weight (``jaxllm/quant``: GGUF
blocks kept packed) stands where a matrix would; ``quant/ops.py`` decides how to multiply by it.
"""

import jax
import jax.numpy as jnp

from jaxllm.cpu import layout
from jaxllm.cpu import native
from jaxllm.formats import storage
from jaxllm.formats.storage import PACKED_BF16
from jaxllm.quant import ops as qops


def matmul(x: jax.Array, w, backend: str = "xla") -> jax.Array:
    """x [T, in] @ w[out, in]^T -> float32 [T, out]; ``backend="native"`` uses jaxllm/cpu
    (``"native-int8"``, ``"native-int16"``: the same, a GGUF weight's blocks by activations
    rounded to int8 or int16: ``quant/ops.py``)."""
    if qops.is_quantized(w):
        return qops.matmul(x, w, backend)
    if backend in qops.NATIVE_BACKENDS:
        return native.linear(x, w)
    if w.dtype == PACKED_BF16:
        w = jax.lax.bitcast_convert_type(w, jnp.bfloat16)
    return jax.lax.dot_general(x.astype(w.dtype), w, (((x.ndim - 1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


def linear(x: jax.Array, w, b: jax.Array | None = None, backend: str = "xla") -> jax.Array:
    # x [T, in], w [out, in] -> [T, out]
    y = matmul(x, w, backend)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)


def embed(w, ids: jax.Array, panels: bool = False) -> jax.Array:
    """Rows ``ids`` [T] of the embedding ``w`` [V, D] -> [T, D], float32 unless ``w`` is a
    plain float matrix on an accelerator; ``panels``: ``w`` is in the native matmul's panel
    layout (a tied embedding that is also the native LM head, runner/weights.py)."""
    if qops.is_quantized(w):
        return qops.take_rows(w, ids)
    x = layout.take_rows(w, ids) if panels else w[ids]
    return storage.load(x) if x.dtype == PACKED_BF16 or panels else x
