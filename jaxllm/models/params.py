"""Parameter tables: every weight of an architecture family declared once.

A table entry (:class:`Param`) says what the engine needs to know about one weight: whether
it is global or repeated in every layer, its shape as a function of ``ArchConfig``, its
storage class, the logical axes of its dimensions, the names checkpoints give it (HF
safetensors and GGUF) and when an architecture has it.  Everything else is derived from
the table: the shapes the loader checks and its one name mapper (``models/loader.py``), the
sharding specs (``parallel/sharding.py`` maps the logical axes to the mesh) and the device
layout (``runner/weights.py``: bf16 packing, the native matmul's panels, fused projections).

Checkpoint name patterns are dot-separated, ``{layer}`` and ``{expert}`` standing for whole
numeric components (``model.layers.{layer}.self_attn.q_proj.weight``).  The first pattern
is the name a missing tensor is reported under; the others are accepted alternatives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from jaxllm.models.config import ArchConfig

GLOBAL, LAYER = "global", "layer"

MATRIX = "matrix"
"""A weight matrix (or a stack of them): bf16 bit patterns on CPU (``formats/storage.py``)."""
VECTOR = "vector"
"""Norm weights, biases, frequencies: float32 on CPU whatever the weight dtype."""

Predicate = Callable[[ArchConfig], bool]


def always(arch: ArchConfig) -> bool:
    return True


def never(arch: ArchConfig) -> bool:
    return False


@dataclass(frozen=True)
class Chunk:
    """A checkpoint tensor that holds the parameter as chunk ``index`` of ``count`` equal
    chunks along ``axis`` (transformers 5's fused experts ``gate_up_proj`` [E, 2F, D]: the
    gate rows first)."""

    pattern: str
    index: int
    count: int
    axis: int
    sizes: Callable[[ArchConfig], tuple[int, ...]] | None = None
    """Unequal chunks: their sizes along ``axis`` (Phi-3's ``qkv_proj``: q rows, then k, then v);
    ``count`` is then ignored."""

    def extent(self, arch: ArchConfig, n: int) -> tuple[int, int]:
        """(offset, total) along ``axis`` of this chunk, ``n`` long, in the stored tensor."""
        if self.sizes is None:
            return self.index * n, self.count * n
        sizes = tuple(self.sizes(arch))
        return sum(sizes[:self.index]), sum(sizes)


@dataclass(frozen=True)
class Stored:
    """A checkpoint tensor that holds the parameter changed by the converter (llama.cpp's
    ``convert_hf_to_gguf.py``); the loader undoes it.  Such a tensor is always decoded to
    float32 (the change is not a row operation a packed weight could take)."""

    pattern: str
    transposed: bool = False
    """Stored with its last two axes swapped (GPT-OSS's experts: ``[E, out, in]``)."""
    offset: float = 0.0
    """Stored as parameter + ``offset`` (Gemma's norms: ``1`` added to every weight)."""
    part: int = 0
    parts: int = 1
    """One of ``parts`` tensors the parameter's last axis interleaves (GPT-OSS's gate and up:
    part 0 the gate's, part 1 the up's, each element of one followed by the other's)."""

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The tensor's shape for a parameter of ``shape``."""
        out = (*shape[:-1], shape[-1] // self.parts)
        return (*out[:-2], out[-1], out[-2]) if self.transposed else out

    def undo(self, a: np.ndarray) -> np.ndarray:
        """The tensor ``a`` back to (its part of) the parameter."""
        if self.transposed:
            a = np.ascontiguousarray(np.swapaxes(a, -1, -2))
        if self.offset:
            a = a - np.float32(self.offset)
        return a


def interleave(parts: list[np.ndarray]) -> np.ndarray:
    """The parameter whose last axis alternates the elements of ``parts`` (:attr:`Stored.parts`)."""
    first = parts[0]
    return np.ascontiguousarray(np.stack(parts, axis=-1).reshape(*first.shape[:-1], len(parts) * first.shape[-1]))


Pattern = str | Chunk | Stored


@dataclass(frozen=True)
class Param:
    name: str
    scope: str
    """GLOBAL, or LAYER: one per layer (stacked ``[L, ...]`` under ``lax.scan``)."""
    kind: str
    """MATRIX or VECTOR (its storage class)."""
    axes: tuple[str, ...]
    """Logical axis of each dimension (of one layer's array)."""
    shape: Callable[[ArchConfig], tuple[int, ...]]
    hf: tuple[Pattern, ...] | Mapping[str, tuple[Pattern, ...]] = ()
    """Safetensors name patterns, or per architecture name where the family's checkpoints differ
    (key ``"*"``: the others)."""
    gguf: tuple[Pattern, ...] | Mapping[str, tuple[Pattern, ...]] = ()
    when: Predicate = always
    """Whether ``arch`` has the parameter."""
    native: Predicate = never
    """Whether the native CPU matmul multiplies by it (it then takes the panel layout)."""
    rope_heads: Callable[[ArchConfig], int] | None = None
    """For q/k projections (weights and biases): their number of heads.  llama.cpp's converter
    permutes such rows for interleaved RoPE (the architectures it runs as Llama:
    ``loader.ROPE_PERMUTED``); the loader undoes it."""
    from_checkpoint: bool = True
    """False for what the loader computes instead of reading (RoPE frequencies)."""
    in_layer: Callable[[ArchConfig, int], bool] | None = None
    """For LAYER parameters present in some layers only (GLM-4-MoE's dense first layers):
    whether layer ``i`` has it; None: every layer."""
    row_order: Callable[[ArchConfig], np.ndarray] | None = None
    """The stored tensor's rows (axis 0, after any :class:`Chunk`) in the order the parameter
    holds them, when the model wants a layout the checkpoint does not store (a hybrid
    model's GDN channels grouped by key head, so tensor parallelism splits whole groups)."""

    def has(self, arch: ArchConfig, layer: int | None) -> bool:
        """Whether layer ``layer`` (None: a global) of ``arch`` holds this parameter."""
        return layer is None or self.in_layer is None or self.in_layer(arch, layer)

    def __post_init__(self):
        for fmt in ("hf", "gguf"):
            names = getattr(self, fmt)
            if isinstance(names, str | Chunk | Stored):
                object.__setattr__(self, fmt, (names,))

    def patterns(self, arch: ArchConfig, fmt: str) -> tuple[Pattern, ...]:
        """This parameter's name patterns in checkpoints of ``arch`` in format ``fmt`` ("hf" or "gguf")."""
        names = self.hf if fmt == "hf" else self.gguf
        if isinstance(names, Mapping):   # "*": every architecture the mapping does not name
            return tuple(names.get(arch.architecture, names.get("*", ())))
        return names


@dataclass(frozen=True)
class Fused:
    """Parameters of one layer the device may hold as one array, their rows concatenated in
    this order (the native matmul: one call instead of several); the model splits the product."""

    name: str
    parts: tuple[str, ...]
    axes: tuple[str, ...]


@dataclass(frozen=True)
class ParamTable:
    params: tuple[Param, ...]
    fused: tuple[Fused, ...] = ()

    def __post_init__(self):
        names = [p.name for p in self.params] + [f.name for f in self.fused]
        if len(set(names)) != len(names):
            raise ValueError(f"parameter table names a parameter twice: {names}")

    def __getitem__(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    def present(self, arch: ArchConfig, scope: str | None = None) -> list[Param]:
        """The parameters ``arch`` has (of ``scope``, if given), in table order."""
        return [p for p in self.params if p.when(arch) and scope in (None, p.scope)]

    def shapes(self, arch: ArchConfig, scope: str) -> dict[str, tuple[int, ...]]:
        """Name -> shape of the parameters of ``scope`` that ``arch`` has (one layer's for LAYER)."""
        return {p.name: tuple(p.shape(arch)) for p in self.present(arch, scope)}

    def axes(self) -> dict[str, tuple[str, ...]]:
        """Name -> logical axes, fused arrays included."""
        return {**{p.name: p.axes for p in self.params}, **{f.name: f.axes for f in self.fused}}

    def _part(self, f: Fused) -> Param:
        return self[f.parts[0]]

    def matrices(self) -> frozenset[str]:
        """Names stored as matrices (bf16 bits on CPU), fused arrays included."""
        return frozenset([p.name for p in self.params if p.kind == MATRIX]
                         + [f.name for f in self.fused if self._part(f).kind == MATRIX])

    def native_matrices(self, arch: ArchConfig) -> frozenset[str]:
        """Names the native CPU matmul multiplies by for ``arch``, fused arrays included."""
        return frozenset([p.name for p in self.params if p.native(arch)]
                         + [f.name for f in self.fused if self._part(f).native(arch)])


def _layer_hf(suffix: str) -> str:
    return "model.layers.{layer}." + suffix


def _layer_gguf(suffix: str) -> str:
    return "blk.{layer}." + suffix


def attention_params(*, proj_hf: Callable | None = None, proj_gguf: Callable | None = None,
                     norm_gguf: Callable[[str], Pattern] | None = None, rope_heads: bool = False,
                     qk_norm: Predicate | None = None) -> tuple[Param, ...]:
    """The attention block's rows, declared once for the decoder families (Llama, Gemma,
    GPT-OSS): the q, k, v, o projections (``[out, D]`` matrices the native matmul reads), the
    q/k/v biases (``arch.qkv_bias``), the o bias (``arch.o_bias``) and, where ``qk_norm`` says
    when, the per-head q/k RMSNorm weights ``[head_dim]``.

    ``proj_hf`` / ``proj_gguf``: ``(name suffix, part)`` -> the projection's name pattern(s),
    ``part`` its index in a fused q/k/v tensor (0, 1, 2; None for o); default the plain
    per-layer names.  ``norm_gguf``: a norm's GGUF pattern from its name (Gemma's ``+ 1``).
    ``rope_heads``: llama.cpp permuted the q/k rows (weights and biases) of this family."""
    hf = proj_hf or (lambda suffix, part: _layer_hf(suffix))
    gguf = proj_gguf or (lambda suffix, part: _layer_gguf(suffix))
    norm = norm_gguf or (lambda name: name)
    q_heads = (lambda a: a.num_heads) if rope_heads else None
    kv_heads = (lambda a: a.num_kv_heads) if rope_heads else None

    def bias(a: ArchConfig) -> bool:
        return a.qkv_bias

    rows = (
        Param("q", LAYER, MATRIX, ("q_heads", "embed"), lambda a: (a.q_size, a.hidden_size),
              hf("self_attn.q_proj.weight", 0), gguf("attn_q.weight", 0), native=always, rope_heads=q_heads),
        Param("k", LAYER, MATRIX, ("kv_heads", "embed"), lambda a: (a.kv_size, a.hidden_size),
              hf("self_attn.k_proj.weight", 1), gguf("attn_k.weight", 1), native=always, rope_heads=kv_heads),
        Param("v", LAYER, MATRIX, ("kv_heads", "embed"), lambda a: (a.kv_size, a.hidden_size),
              hf("self_attn.v_proj.weight", 2), gguf("attn_v.weight", 2), native=always),
        Param("o", LAYER, MATRIX, ("embed", "q_heads"), lambda a: (a.hidden_size, a.q_size),
              hf("self_attn.o_proj.weight", None), gguf("attn_output.weight", None), native=always),
        Param("q_bias", LAYER, VECTOR, ("q_heads",), lambda a: (a.q_size,), _layer_hf("self_attn.q_proj.bias"),
              _layer_gguf("attn_q.bias"), when=bias, rope_heads=q_heads),
        Param("k_bias", LAYER, VECTOR, ("kv_heads",), lambda a: (a.kv_size,), _layer_hf("self_attn.k_proj.bias"),
              _layer_gguf("attn_k.bias"), when=bias, rope_heads=kv_heads),
        Param("v_bias", LAYER, VECTOR, ("kv_heads",), lambda a: (a.kv_size,), _layer_hf("self_attn.v_proj.bias"),
              _layer_gguf("attn_v.bias"), when=bias),
        Param("o_bias", LAYER, VECTOR, ("embed",), lambda a: (a.hidden_size,), _layer_hf("self_attn.o_proj.bias"),
              _layer_gguf("attn_output.bias"), when=lambda a: a.o_bias),
    )
    if qk_norm is None:
        return rows
    return rows + (
        Param("q_norm", LAYER, VECTOR, ("head_dim",), lambda a: (a.head_dim,), _layer_hf("self_attn.q_norm.weight"),
              norm(_layer_gguf("attn_q_norm.weight")), when=qk_norm),
        Param("k_norm", LAYER, VECTOR, ("head_dim",), lambda a: (a.head_dim,), _layer_hf("self_attn.k_norm.weight"),
              norm(_layer_gguf("attn_k_norm.weight")), when=qk_norm),
    )
