"""What every GGUF load does to the file's tensors, whatever its architecture: the decision
which matrices stay in their blocks, the one thread pool that dequantizes the rest, and the
undoing of llama.cpp's Q/K row permutation.  ``models/loader.load_gguf`` reads every GGUF
file through it.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from jaxllm.errors import ModelLoadError
from jaxllm.models.params import MATRIX
from jaxllm.quant import gguf_blocks, ops

# gguf.quants decodes a quantized tensor 16 rows at a time, a dozen numpy calls per group;
# on the built-in model's narrow rows (576 x Q4_1 = 360 bytes) that per-call overhead is a
# large share of the time, and it holds the GIL.  Rows of about this many bytes amortize it;
# much longer ones make each group's temporaries big enough that, in a fresh process, the
# allocator maps and unmaps them on every call and page faults eat the gain (measured:
# 32 KiB rows were slower than no merging at all, 2-4 KiB the fastest).
_DEQUANT_ROW_BYTES = 2048


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's ``LlamaModel.permute`` of Q/K rows (interleaved -> rotate-half
    pairs); ``w`` [out, ...] (a weight or a bias), ``n_heads`` heads of ``out // n_heads`` rows."""
    out = w.shape[0]
    return w.reshape(n_heads, out // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def map_rows(a, fn):
    """``fn`` on a float array, or on every field of a packed weight (each has the rows first)."""
    return ops.map_fields(a, fn) if ops.is_quantized(a) else fn(a)


def keeps_packed(t, params, arch, dequantize: bool) -> bool:
    """Whether GGUF tensor ``t`` stays in its blocks (``quant/gguf_blocks.PackedWeight``): a
    type the block kernels read, and every parameter it gives a 2-D matrix (None among
    ``params``: a parameter ``arch`` lacks); ``dequantize``: never."""
    return (not dequantize and t.tensor_type.name in gguf_blocks.SUPPORTED_TYPES and bool(params)
            and all(p is not None and p.kind == MATRIX and len(p.shape(arch)) == 2 for p in params))


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _dequantize_gguf_tensor(dequantize, t):
    """``(gguf.quants.dequantize(t.data, t.tensor_type), None)``, or ``(None, error)`` when the
    gguf package cannot decode the type.

    A quantized tensor's bytes are independent blocks laid out row after row, and every
    ggml block format decodes block by block, so ``k`` consecutive rows decode exactly like
    one row ``k`` times as long: the tensor is handed over as fewer, longer rows (``k``
    divides the row count) and the result reshaped back, bit for bit what the plain call
    gives."""
    data = t.data
    try:
        if data.dtype == np.uint8 and data.ndim >= 2 and data.size:
            row_bytes = data.shape[-1]
            n_rows = data.size // row_bytes
            k = max(1, min(n_rows, _DEQUANT_ROW_BYTES // row_bytes))
            while n_rows % k:
                k -= 1
            out = dequantize(data.reshape(n_rows // k, k * row_bytes), t.tensor_type)
            return out.reshape(*data.shape[:-1], -1), None
        return dequantize(data, t.tensor_type), None
    except NotImplementedError as e:
        return None, e


def dequantize_all(tensors: list, path: str) -> dict[str, np.ndarray]:
    """Name -> float32 array of each GGUF tensor in ``tensors``.  Decoding is most of a load;
    numpy releases the GIL in the long passes :func:`_dequantize_gguf_tensor` makes, so the
    tensors decode in parallel; the first failure in file order is raised, naming the tensor."""
    # Imported only once a GGUF file is read: an install without the gguf package still loads
    # HF folders, and load_model names the package.
    from gguf.quants import dequantize as gguf_dequantize
    workers = min(4, _cpu_count(), len(tensors))
    if workers > 1:
        with ThreadPoolExecutor(workers, thread_name_prefix="gguf-dequantize") as pool:
            futures = [pool.submit(_dequantize_gguf_tensor, gguf_dequantize, t) for t in tensors]
            try:
                decoded = [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
    else:
        decoded = [_dequantize_gguf_tensor(gguf_dequantize, t) for t in tensors]
    out = {}
    for t, (arr, err) in zip(tensors, decoded):
        if err is not None:
            raise ModelLoadError(f"{path}: tensor {t.name!r} uses quantization {t.tensor_type.name}, "
                                 f"which the gguf package cannot dequantize ({err})") from None
        out[t.name] = np.asarray(arr, dtype=np.float32)
    return out
