"""Weights as the device holds them: dtype, storage and layout derived from the loaded
checkpoint and the model's parameter table (``models/params.py``: fused projections and the
panel layout for the native CPU matmul, bf16 bit patterns on CPU for its matrices), placed
on the replica's mesh by the sharding rules; and the KV cache's arrays."""

from __future__ import annotations

from collections.abc import Collection

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import host_memory
from jaxllm.cpu import layout
from jaxllm.cpu import native as cpu_native
from jaxllm.formats import kv_pages
from jaxllm.models.kernels import Kernels
from jaxllm.models.loader import LoadedModel
from jaxllm.models.params import Fused, ParamTable
from jaxllm.models.registry import get_model_module
from jaxllm.parallel import mesh as pmesh
from jaxllm.parallel import sharding as psh
from jaxllm.quant import native_matmul
from jaxllm.quant import ops as qops


def fused_parts(layer: dict, groups: tuple[Fused, ...]) -> dict[str, list[np.ndarray]]:
    """One layer's weights by name, each fused group whose parts the layer has (q, k, v and
    their biases as one ``qkv`` and ``qkv_bias``, gate and up as one ``gate_up``) under its
    name: each name maps to the arrays whose rows it concatenates (one for the others).

    For the native CPU matmul: 4 calls per layer instead of 7, each a longer stream of rows
    (every call pays a thread-pool round trip and a cold start of the prefetcher)."""
    out, taken = {}, set()
    for group in groups:
        if all(n in layer for n in group.parts) and _fusable([layer[n] for n in group.parts]):
            out[group.name] = [layer[n] for n in group.parts]
            taken.update(group.parts)
    out.update({k: [v] for k, v in layer.items() if k not in taken})
    return out


def _fusable(parts: list) -> bool:
    if not any(qops.is_quantized(p) for p in parts):
        return True
    return qops.concatenable(parts)


def param_table(model: LoadedModel) -> ParamTable:
    return get_model_module(model.arch.architecture).PARAMS


def interleaved_types(kernels: Kernels) -> tuple[str, ...]:
    """The GGUF types the step's native kernels read in interleaved groups of 16 rows where the
    CPU has AVX-512 VNNI (quant/native_matmul.interleave_rows): the 8-bit-activation kernel's
    types, the 16-bit one's Q4_1 and Q8_0; none for float32 activations or elsewhere."""
    if kernels.matmul != "native" or not cpu_native.quant_dot_vnni():
        return ()
    if kernels.int8_activations:
        return native_matmul.INTERLEAVED_TYPES
    return native_matmul.INT16_INTERLEAVED_TYPES if kernels.int16_activations else ()


def host_params(model: LoadedModel, dtype, scan_layers: bool, packed_bf16: bool, native: bool = False,
                interleave: Collection[str] = ()) -> dict:
    """Host weights in the device dtype and layout.  ``packed_bf16``: matrices as bf16 bit
    patterns in uint16 and vectors (norms, biases) as float32 (see formats/storage.py);
    ``native``: laid out for the native CPU matmul: unrolled layers get fused projections
    (:func:`fused_parts`) and its matrices the panel layout (cpu/layout.py), the tied
    embedding included since it is the LM head.  Quantized weights stay as loaded, except
    that those of the GGUF types in ``interleave`` (the 8- and 16-bit-activation kernels on a
    CPU with AVX-512 VNNI) are laid out, where they can be, in interleaved groups of 16 rows
    (quant/native_matmul.interleave_rows)."""
    np_dtype = jnp.dtype(dtype)
    table = param_table(model)
    matrices = table.matrices()
    panels = table.native_matrices(model.arch) if native else frozenset()

    def conv(name, *parts):   # parts: arrays whose rows are concatenated (fused projections)
        if qops.is_quantized(parts[0]):
            # kept as stored: the native kernel reads the blocks row by row, no panels
            w = parts[0] if len(parts) == 1 else qops.concat_rows(list(parts))
            grouped = w.type_name in interleave and native_matmul.can_interleave(w)
            return native_matmul.interleave_rows(w) if grouped else w

        def cast(a):
            a = np.asarray(a)
            if packed_bf16:
                return a.astype(jnp.bfloat16).view(np.uint16) if name in matrices else a.astype(np.float32)
            return a.astype(np_dtype, copy=False)
        parts = [cast(a) for a in parts]
        if name in panels:
            return layout.pack_rows(parts)       # concatenated and laid out in one pass
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    params = {k: conv(k, v) for k, v in model.globals.items()}
    if scan_layers:
        params["layers"] = {k: conv(k, _stack([lp[k] for lp in model.layers], k)) for k in model.layers[0]}
    elif native:
        params["layers"] = [{k: conv(k, *v) for k, v in fused_parts(lp, table.fused).items()} for lp in model.layers]
    else:
        params["layers"] = [{k: conv(k, v) for k, v in lp.items()} for lp in model.layers]
    params["rope_inv_freq"] = model.rope_inv_freq.astype(np.float32)
    for name, table in model.rope_tables.items():
        params[name] = table.astype(np.float32)
    return params


def _stack(arrays: list, name: str):
    return qops.stack(arrays, name) if qops.is_quantized(arrays[0]) else np.stack(arrays)


def to_device_params(model: LoadedModel, dtype, scan_layers: bool, packed_bf16: bool = False,
                      mesh=None, rules: dict | None = None, native: bool = False,
                      interleave: Collection[str] = ()) -> dict:
    """Host weights -> device arrays, on ``mesh`` laid out by the sharding ``rules``
    (parallel/sharding.py); without a mesh, on the default device.  On one CPU device the
    arrays alias host memory in 2 MiB pages (host_memory.in_huge_pages)."""
    host = host_params(model, dtype, scan_layers, packed_bf16, native, interleave)
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    if len(devices) == 1 and devices[0].platform == "cpu" and jax.process_count() == 1:
        # The CPU backend aliases these host arrays: the weights stay in 2 MiB pages.
        host = host_memory.in_huge_pages(host)
    if mesh is None:
        return jax.tree.map(jax.device_put, host)
    specs = psh.param_specs(host, rules or {}, param_table(model).axes(), mesh.shape.get(pmesh.TP, 1))
    shardings = psh.named(mesh, specs)
    return jax.tree.map(pmesh.place, host, shardings)


def allocate_kv_cache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, stacked: bool,
                      make=jnp.zeros):
    """Zeroed (K, V): stacked over layers for the scanned model, per-layer lists for the unrolled one.
    ``dtype``: the arrays' dtype, or a quantized cache's ``kv_pages.KVFormat`` (each K or V
    then a ``QuantPages``: values and scales).  ``make=jax.ShapeDtypeStruct`` gives the
    shapes without allocating."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if isinstance(dtype, kv_pages.KVFormat):
        one = lambda s: kv_pages.allocate(dtype, s, make)  # noqa: E731
    else:
        one = lambda s: make(s, dtype)  # noqa: E731
    if stacked:
        return tuple(one((num_layers, *shape)) for _ in range(2))
    return tuple([one(shape) for _ in range(num_layers)] for _ in range(2))
