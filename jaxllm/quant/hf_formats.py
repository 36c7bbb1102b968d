"""HF quantized checkpoint formats (what vLLM serves from ``quantization_config``) read into
``int_weights.QuantizedLinear``: the loader hands over a folder's tensors by name and gets
them back with each quantized linear's tensor group replaced by one weight under the
``<module>.weight`` name its parameter table knows.

  ===================== ======================================================================
  quant_method          tensors of a quantized module ``<m>``
  ===================== ======================================================================
  compressed-tensors    pack-quantized: ``weight_packed`` int32 ``[out, ceil(in / (32/b))]``
                        (weight ``i`` of a row in bits ``b * (i % (32/b))`` of word ``i // (32/b)``,
                        stored as ``q + 2^(b-1)``), ``weight_shape`` ``[2]``, ``weight_scale``
                        ``[out, 1 | G]``, optional ``weight_zero_point`` (int32, packed the same
                        way along the rows: ``[ceil(out / (32/b)), G]``); b = 4 or 8.
                        naive-/int-/float-quantized: ``weight`` int8 or F8_E4M3 ``[out, in]``,
                        ``weight_scale`` per tensor, channel, group or block, optional
                        ``weight_zero_point``; ``input_scale``/``input_zero_point`` (static
                        activation quantization) are read and dropped: activations stay float.
  gptq                  ``qweight`` int32 ``[in / (32/b), out]`` (packed along the input
                        features), ``qzeros`` int32 ``[G, out / (32/b)]`` (along the outputs;
                        checkpoint_format "gptq" stores ``zero - 1``, "gptq_v2" the zero),
                        ``scales`` ``[G, out]``, ``g_idx`` ``[in]``; ``w = (q - zero) * scale``;
                        b = 4 or 8, no act-order (desc_act) reordering.
  fp8                   ``weight`` F8_E4M3 ``[out, in]`` with ``weight_scale_inv``
                        ``[ceil(out / bo), ceil(in / bi)]`` (``weight_block_size`` [bo, bi]: the
                        multiplier, despite its name) or a per-tensor ``weight_scale``.
  ===================== ======================================================================

Modules a checkpoint leaves unquantized (``ignore``, ``modules_to_not_convert``: the
embedding, often the LM head) keep their float ``weight`` and pass through untouched.  A
quantized module missing a companion tensor is a ``ModelLoadError`` naming the tensor; a
companion without its module's quantized weight is one too.
"""

from __future__ import annotations

import logging

import ml_dtypes
import numpy as np

from jaxllm.errors import ModelLoadError
from jaxllm.formats import int_weights

log = logging.getLogger("jaxllm.quant")

CHECKPOINT_METHODS = ("compressed-tensors", "gptq", "fp8")
"""``quant_method`` values (and ``--quantization`` names) of the checkpoint formats read here."""

_CT_FORMATS = ("pack-quantized", "naive-quantized", "int-quantized", "float-quantized")
_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)

# leaf names that belong to a quantized module (its "weight" aside)
_COMPANIONS = {
    "compressed-tensors": ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_g_idx",
                           "input_scale", "input_zero_point"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "fp8": ("weight_scale_inv", "weight_scale", "input_scale"),
}


def checkpoint_method(qcfg: dict | None, where: str) -> str | None:
    """The checkpoint's quantization method from config.json's ``quantization_config`` (None:
    a float checkpoint); one this engine does not read is refused by name."""
    if not qcfg:
        return None
    method = qcfg.get("quant_method")
    if method not in CHECKPOINT_METHODS:
        raise ModelLoadError(f"{where}: quantization_config.quant_method {method!r} is not supported "
                             f"(supported: {', '.join(CHECKPOINT_METHODS)})")
    if method == "compressed-tensors":
        formats = {qcfg.get("format")} | {g.get("format") for g in (qcfg.get("config_groups") or {}).values()}
        bad = sorted(f for f in formats - {None} if f not in _CT_FORMATS)
        if bad:
            raise ModelLoadError(f"{where}: compressed-tensors format {bad[0]!r} is not supported "
                                 f"(supported: {', '.join(_CT_FORMATS)})")
    if method == "gptq":
        if qcfg.get("desc_act"):
            raise ModelLoadError(f"{where}: GPTQ with desc_act=true (act-order: input features permuted by "
                                 "g_idx) is not supported; use a checkpoint quantized with desc_act=false")
        if int(qcfg.get("bits", 4)) not in (4, 8):
            raise ModelLoadError(f"{where}: GPTQ bits={qcfg.get('bits')} is not supported (4 or 8)")
        fmt = qcfg.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ModelLoadError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
    return method


def build(method: str, qcfg: dict, tensors: dict, where: str) -> dict:
    """``tensors`` (name -> (array, file)) with every quantized module's tensors replaced by
    ``<module>.weight`` -> (QuantizedLinear, file)."""
    companions = _COMPANIONS[method]
    by_module: dict[str, dict[str, str]] = {}
    for name in tensors:
        module, _, leaf = name.rpartition(".")
        if leaf in companions or leaf == "weight":
            by_module.setdefault(module, {})[leaf] = name
    out = dict(tensors)
    dropped = 0
    for module, leaves in by_module.items():
        get = _Getter(module, leaves, tensors, where)
        primary = _primary(method, leaves, tensors)
        if primary is None:
            stray = sorted(set(leaves) - {"weight"})
            if stray:
                raise ModelLoadError(f"{where}: tensor {leaves[stray[0]]!r} has no quantized weight beside it "
                                     f"(expected {module}.{_PRIMARY_NAME[method]})")
            continue
        qw = {"compressed-tensors": _compressed_tensors, "gptq": _gptq, "fp8": _fp8}[method](get, qcfg)
        fname = tensors[leaves[primary]][1]
        for leaf, name in leaves.items():
            if leaf in ("input_scale", "input_zero_point"):
                dropped += 1
            if name not in get.used and leaf not in ("input_scale", "input_zero_point"):
                raise ModelLoadError(f"{where}: tensor {name!r} is not used by {method} weight {module}")
            del out[name]
        out[f"{module}.weight"] = (qw, fname)
    if dropped:
        log.info("%d static activation scales ignored: activations stay float (weight-only)", dropped)
    return out


_PRIMARY_NAME = {"compressed-tensors": "weight_packed or .weight (int8/fp8)", "gptq": "qweight",
                 "fp8": "weight (F8_E4M3)"}


def _primary(method: str, leaves: dict, tensors: dict) -> str | None:
    if method == "gptq":
        return "qweight" if "qweight" in leaves else None
    if method == "compressed-tensors" and "weight_packed" in leaves:
        return "weight_packed"
    if "weight" in leaves:
        dtype = tensors[leaves["weight"]][0].dtype
        if dtype == _FP8 or (method == "compressed-tensors" and dtype == np.int8):
            return "weight"
    return None


class _Getter:
    """One module's tensors by leaf name; a missing required one is an error naming it."""

    def __init__(self, module, leaves, tensors, where):
        self.module, self.leaves, self.tensors, self.where = module, leaves, tensors, where
        self.used: set[str] = set()

    def name(self, leaf: str) -> str:
        return f"{self.module}.{leaf}"

    def __call__(self, leaf: str, required: bool = True):
        name = self.leaves.get(leaf)
        if name is None:
            if required:
                raise ModelLoadError(f"{self.where}: missing tensor {self.name(leaf)!r} "
                                     f"(needed by the quantized weight {self.module})")
            return None
        self.used.add(name)
        return np.asarray(self.tensors[name][0])

    def error(self, leaf: str, msg: str) -> ModelLoadError:
        return ModelLoadError(f"{self.where}: tensor {self.name(leaf)!r} {msg}")


def _unpack_words(words: np.ndarray, bits: int, axis: int, n: int) -> np.ndarray:
    """int32 words holding ``32 / bits`` unsigned values each, lowest bits first, along ``axis``
    -> int64 values, ``n`` of them along ``axis``."""
    pf = 32 // bits
    w = np.moveaxis(np.asarray(words).view(np.uint32), axis, -1)          # [..., words]
    shifts = (bits * np.arange(pf, dtype=np.uint32))
    v = (w[..., None] >> shifts) & np.uint32((1 << bits) - 1)             # [..., words, pf]
    v = v.reshape(*w.shape[:-1], -1)[..., :n].astype(np.int64)
    return np.moveaxis(v, -1, axis)


def _pack_int4(u: np.ndarray) -> np.ndarray:
    """Unsigned nibbles [out, in] -> uint8 [out, ceil(in / 2)], column 2j low, 2j + 1 high."""
    if u.shape[1] % 2:
        u = np.pad(u, ((0, 0), (0, 1)))
    return (u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8)


def _scales(get: _Getter, leaf: str, n_out: int, n_in: int, group_hint: int | None = None,
            block: list | None = None) -> tuple[np.ndarray, int]:
    """A scale tensor of any granularity -> (float32 [out, G], group size along ``in``)."""
    s = get(leaf).astype(np.float32)
    if s.size == 1:                                                       # per tensor
        return np.full((n_out, 1), s.reshape(()), np.float32), n_in
    if s.ndim == 1 and s.shape[0] == n_out:
        s = s[:, None]
    if s.ndim != 2:
        raise get.error(leaf, f"has shape {list(s.shape)}, not a scale of a [{n_out}, {n_in}] weight")
    R, C = s.shape
    if R != n_out:                                                        # 2-D blocks: repeat the rows
        br = int(block[0]) if block else -(-n_out // R)
        if -(-n_out // br) != R:
            raise get.error(leaf, f"has {R} rows, which blocks of {br} rows of a [{n_out}, {n_in}] weight do not make")
        s = np.repeat(s, br, axis=0)[:n_out]
    if C == 1:
        return np.ascontiguousarray(s), n_in
    g = int(block[1]) if block else (group_hint or -(-n_in // C))
    if -(-n_in // g) != C:
        raise get.error(leaf, f"has {C} columns, which groups of {g} of {n_in} input features do not make")
    return np.ascontiguousarray(s), g


def _group_hint(qcfg: dict) -> int | None:
    sizes = {(g.get("weights") or {}).get("group_size") for g in (qcfg.get("config_groups") or {}).values()}
    sizes.discard(None)
    return sizes.pop() if len(sizes) == 1 else None


def _compressed_tensors(get: _Getter, qcfg: dict):
    if get.leaves.get("weight_g_idx") is not None:
        raise get.error("weight_g_idx", "is an act-order permutation (actorder), which is not supported")
    if "weight_packed" in get.leaves:
        packed = get("weight_packed")
        shape = get("weight_shape").reshape(-1)
        if packed.dtype != np.int32 or shape.size != 2:
            raise get.error("weight_packed", f"is {packed.dtype} {list(packed.shape)}; expected int32 words and a "
                            "two-element weight_shape")
        n_out, n_in = int(shape[0]), int(shape[1])
        bits = next((b for b in (4, 8) if -(-n_in // (32 // b)) == packed.shape[1]), None)
        if bits is None or packed.shape[0] != n_out:
            raise get.error("weight_packed", f"has shape {list(packed.shape)}, which packs neither 4- nor 8-bit "
                            f"weights of shape {[n_out, n_in]}")
        offset = 1 << (bits - 1)
        u = _unpack_words(packed, bits, 1, n_in)                          # [out, in], q + offset
        s, g = _scales(get, "weight_scale", n_out, n_in, _group_hint(qcfg))
        zp = get("weight_zero_point", required=False)
        zero = None
        if zp is not None:
            if zp.dtype == np.int32 and zp.shape[0] == -(-n_out // (32 // bits)):
                zp = _unpack_words(zp, bits, 0, n_out) - offset           # [out, G] signed
            zero = zp.astype(np.int64).reshape(n_out, -1)
        if bits == 4:   # kept unsigned: u = q + 8, zero likewise
            return int_weights.make(_pack_int4(u), s, None if zero is None else zero + offset,
                                    format="int4", group_size=g, shape=(n_out, n_in))
        return int_weights.make((u - offset).astype(np.int8), s, zero, format="int8", group_size=g,
                                shape=(n_out, n_in))
    w = get("weight")
    n_out, n_in = w.shape
    s, g = _scales(get, "weight_scale", n_out, n_in, _group_hint(qcfg))
    if w.dtype == _FP8:
        return int_weights.make(w, s, format="fp8", group_size=g, shape=w.shape)
    zp = get("weight_zero_point", required=False)
    zero = None if zp is None else np.broadcast_to(zp.astype(np.int64).reshape(n_out, -1), s.shape)
    return int_weights.make(w, s, zero, format="int8", group_size=g, shape=w.shape)


def _gptq(get: _Getter, qcfg: dict):
    bits = int(qcfg.get("bits", 4))
    pf = 32 // bits
    qweight, qzeros = get("qweight"), get("qzeros")
    scales = get("scales").astype(np.float32)                              # [G, out]
    n_in, n_out = qweight.shape[0] * pf, qweight.shape[1]
    group = int(qcfg.get("group_size", -1))
    group = n_in if group <= 0 else group
    G = -(-n_in // group)
    if scales.shape != (G, n_out):
        raise get.error("scales", f"has shape {list(scales.shape)}, expected {[G, n_out]} "
                        f"(group_size {group} of {n_in} inputs)")
    if qzeros.shape != (G, -(-n_out // pf)):
        raise get.error("qzeros", f"has shape {list(qzeros.shape)}, expected {[G, -(-n_out // pf)]}")
    g_idx = get("g_idx", required=False)
    if g_idx is not None and not np.array_equal(g_idx.reshape(-1), np.arange(n_in) // group):
        raise get.error("g_idx", "permutes the input features (act-order / desc_act), which is not supported")
    u = _unpack_words(qweight, bits, 0, n_in).T                            # [out, in] unsigned
    z = _unpack_words(qzeros, bits, 1, n_out).T                           # [out, G]
    if qcfg.get("checkpoint_format", "gptq") == "gptq":
        z = z + 1                     # v1 checkpoints store zero - 1
    s = np.ascontiguousarray(scales.T)                                     # [out, G]
    if bits == 4:
        return int_weights.make(_pack_int4(u), s, z, format="int4", group_size=group, shape=(n_out, n_in))
    if z.max() > 255:
        raise get.error("qzeros", "holds a zero point of 256 (v1 overflow), which an int8 weight cannot take")
    return int_weights.make((u - 128).astype(np.int8), s, z - 128, format="int8", group_size=group,
                            shape=(n_out, n_in))


def _fp8(get: _Getter, qcfg: dict):
    w = get("weight")
    n_out, n_in = w.shape
    block = qcfg.get("weight_block_size")
    if block is not None or "weight_scale" not in get.leaves:   # blockwise: the usual fp8 checkpoint
        s, g = _scales(get, "weight_scale_inv", n_out, n_in, block=block)
    else:
        s, g = _scales(get, "weight_scale", n_out, n_in)
    return int_weights.make(w, s, format="fp8", group_size=g, shape=w.shape)
