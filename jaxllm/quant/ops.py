"""What the engine does with a quantized weight, whatever its format: the one place that
knows the quantized weight types.

A quantized weight is a pytree (its arrays are leaves, its format static) that stands where
a ``[out, in]`` matrix would: ``layers/linear.py`` multiplies by it, the embedding takes its
rows, ``runner/weights.py`` fuses and stacks it, ``parallel/sharding.py`` splits it.  Every
field array of a format has the weight's ``out`` rows as its first axis and its ``in``
columns (or their blocks) as its second, so row operations (fusing projections, undoing
llama.cpp's q/k permutation, gathering embedding rows) and sharding apply to each field
alike.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

import jax
import numpy as np

from jaxllm.formats import int_weights
from jaxllm.formats.int_weights import QuantizedLinear
from jaxllm.pallas.quant_matmul import quant_matmul, supported
from jaxllm.quant import native_matmul
from jaxllm.quant.gguf_blocks import PackedWeight, dequantize
from jaxllm.quant.matmul import matmul as dequantize_matmul

QUANTIZED_TYPES = (PackedWeight, QuantizedLinear)
NATIVE_BACKENDS = ("native", "native-int8", "native-int16")   # the CPU kernels' backends (Kernels.linear)


def is_quantized(w) -> bool:
    return isinstance(w, QUANTIZED_TYPES)


def format_name(w) -> str:
    """The weight's storage format as the load log names it (``Q4_1``, ``F32``, ``bfloat16``)."""
    if isinstance(w, (PackedWeight, QuantizedLinear)):
        return w.type_name
    dtype = str(np.dtype(w.dtype))
    return {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "uint16": "BF16"}.get(dtype, dtype)


def _fields(w) -> dict:
    if isinstance(w, QuantizedLinear):
        return {f: getattr(w, f) for f in ("q", "scale", "zero") if getattr(w, f) is not None}
    return {f: getattr(w, f) for f in ("d", "qs", "m", "qh", "dmin", "scales", "ql", "bits")
            if getattr(w, f) is not None}


def _rebuild(w, arrays: dict, shape: tuple[int, int]):
    """A weight of ``w``'s type and format with the field ``arrays`` and logical ``shape``."""
    if isinstance(w, QuantizedLinear):
        return QuantizedLinear(**arrays, format=w.format, group_size=w.group_size, shape=shape)
    return PackedWeight(**arrays, type_name=w.type_name, shape=shape, interleaved=w.interleaved,
                        activations=w.activations)


def _row_major(parts) -> None:
    if any(getattr(p, "interleaved", 0) for p in parts):
        # their rows are stored 16 at a time, parts of each interleaved with the others'
        raise ValueError("a weight in the interleaved layout cannot be concatenated or stacked; interleave it last")


def map_fields(w, fn: Callable, shape: tuple[int, int] | None = None):
    """``fn`` applied to every field array (each has the ``out`` rows first); ``shape``: the
    result's logical shape when ``fn`` changes the number of rows."""
    return _rebuild(w, {k: fn(a) for k, a in _fields(w).items()}, shape or w.shape)


def _kind(w) -> tuple:
    """What must agree for weights to be concatenated or stacked: type, format, row width."""
    if isinstance(w, QuantizedLinear):
        return (QuantizedLinear, w.format, w.group_size, w.zero is not None, w.shape[1])
    return (PackedWeight, w.type_name, w.shape[1], w.activations)


def concatenable(parts: list) -> bool:
    """Whether the quantized ``parts`` can be one weight's rows: one type, format and width
    (a Q4_K_M file quantizes v more finely than q and k)."""
    return all(is_quantized(p) and _kind(p) == _kind(parts[0]) for p in parts)


def concat_rows(parts: list[PackedWeight]) -> PackedWeight | None:
    """The rows of ``parts`` as one weight (fused projections), or None when they cannot be
    one (:func:`concatenable`)."""
    first = parts[0]
    _row_major(parts)
    if not concatenable(parts):
        return None
    fields = [_fields(p) for p in parts]
    return _rebuild(first, {k: np.concatenate([np.asarray(f[k]) for f in fields]) for k in fields[0]},
                    (sum(p.shape[0] for p in parts), first.shape[1]))


def stack(layers: list[PackedWeight], name: str) -> PackedWeight:
    """One parameter's weights of every layer stacked ``[L, ...]`` (for ``lax.scan``, which
    slices the stack back into one layer's weight of the same shape and type)."""
    _row_major(layers)
    kinds = {(_kind(w), w.shape) for w in layers}
    if len(kinds) > 1:
        raise ValueError(f"parameter {name!r} is quantized differently across layers "
                         f"({', '.join(sorted({format_name(w) for w in layers}))}), so its layers cannot be "
                         "stacked for --scan-layers; leave the layers unrolled")
    fields = [_fields(w) for w in layers]
    return _rebuild(layers[0], {k: np.stack([np.asarray(f[k]) for f in fields]) for k in fields[0]},
                    layers[0].shape)


def uniform_across_layers(layers: list[dict]) -> bool:
    """Whether every parameter has one format in every layer (so the layers can be stacked)."""
    for name in layers[0]:
        if len({(format_name(lp[name]), getattr(lp[name], "shape", None),
                 _kind(lp[name]) if is_quantized(lp[name]) else None) for lp in layers}) > 1:
            return False
    return True


def matmul(x: jax.Array, w, backend: str) -> jax.Array:
    """x [T, in] @ W[out, in]^T -> float32 [T, out] for a quantized ``w``.

    GGUF blocks: ``backend="native"`` (decided by ``engine/resolve.py``): the CPU kernel that
    reads the blocks (``quant/native_matmul.py``) for the types it has; ``"native-int8"``: the
    same with int8-rounded activations, or as the weight's ``activations`` says
    (``quant/activations.py``); ``"native-int16"``: Q4_1 blocks, and Q8_0 ones in interleaved
    rows (AVX-512 VNNI), by int16-rounded activations, the other types as ``"native"``;
    others, and every other backend, dequantize inside the step
    (``quant/matmul.py``).  int8 / int4 / fp8
    (``QuantizedLinear``): the Pallas kernel (``pallas/quant_matmul.py``) with
    ``backend="pallas"`` (resolve's choice on a GPU), for the group sizes it takes; else, CPU
    included, the XLA path (dequantize in the step, float32 dot)."""
    if isinstance(w, PackedWeight):
        int16 = backend == "native-int16" and native_matmul.has_int16_kernel(w)
        if w.interleaved and not (backend == "native-int8" or int16):
            w = native_matmul.deinterleave_rows(w)
        if backend in NATIVE_BACKENDS:
            if w.type_name in native_matmul.NATIVE_TYPES:
                int8 = backend == "native-int8" and w.type_name in native_matmul.INT8_ACTIVATION_TYPES
                if int16:
                    return native_matmul.linear_packed(x, w, int16_activations=True)
                if int8 and w.activations == "split":    # quant/activations.py's choice per projection
                    return native_matmul.linear_packed_split(x, w)
                return native_matmul.linear_packed(x, w, int8_activations=int8)
        return dequantize_matmul(x, w)
    if isinstance(w, QuantizedLinear):
        if _pallas(backend, w):
            return quant_matmul(x, w)
        return int_weights.matmul(x, w)
    raise TypeError(f"not a quantized weight: {type(w).__name__}")


def _pallas(backend: str, w: QuantizedLinear) -> bool:
    return backend == "pallas" and supported(w)


def take_rows(w, ids: jax.Array) -> jax.Array:
    """Rows ``ids`` [T] of a quantized ``[V, D]`` weight (an embedding) -> float32 [T, D]:
    only the gathered rows' blocks are decoded."""
    if isinstance(w, QuantizedLinear):
        return int_weights.take_rows(w, ids)
    if isinstance(w, PackedWeight):
        if w.interleaved:
            return dequantize(native_matmul.take_interleaved_rows(w, ids))
        rows = map_fields(w, lambda a: a[ids], shape=(ids.shape[0], w.shape[1]))
        return dequantize(rows)
    raise TypeError(f"not a quantized weight: {type(w).__name__}")


def rounded_activations(kernels, tensors: Iterable) -> str:
    """What the native matmul rounds activations to for these weights, for the start-up log
    (a user comparing outputs with another engine's should see it): ``""`` where it keeps
    float32 (``kernels``: the step's ``models.kernels.Kernels``)."""
    if kernels.matmul != "native":
        return ""
    if kernels.int8_activations:
        return "activations rounded to int8 per 32 values (--cpu-matmul native-int8)"
    types = sorted({w.type_name for w in tensors if isinstance(w, PackedWeight) and native_matmul.has_int16_kernel(w)})
    if kernels.int16_activations and types:
        return (f"{'/'.join(types)} by activations rounded to int16 per 32 values (float32's perplexity; "
                "--cpu-matmul native keeps float32)")
    return ""


def summary(tensors: Iterable) -> str:
    """``"210 Q4_1, 1 Q8_0 (97.6 MiB), 61 F32 (0.3 MiB)"``: how many weights of each format."""
    counts, nbytes = Counter(), Counter()
    for w in tensors:
        name = format_name(w)
        counts[name] += 1
        nbytes[name] += int(w.nbytes)
    return ", ".join(f"{counts[k]} {k} ({nbytes[k] / 2**20:.1f} MiB)" for k in sorted(counts, key=lambda k: -nbytes[k]))
