"""Writers of HF quantized checkpoints for the tests: each quantizes a float [out, in] matrix
with numpy into one format's tensors (``tensors``) and returns the weights those tensors
stand for, dequantized in float64 and rounded once to float32 (``deq``).  Written from the
formats' definitions (``jaxllm/quant/hf_formats.py``'s table), apart from the loader."""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

FP8 = ml_dtypes.float8_e4m3fn


def pack_words(v: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Unsigned values -> int32 words, 32 / bits per word, lowest bits first, along ``axis``."""
    pf = 32 // bits
    v = np.moveaxis(np.asarray(v, np.uint32), axis, -1)
    pad = -v.shape[-1] % pf
    v = np.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, pad)]).reshape(*v.shape[:-1], -1, pf)
    words = np.zeros(v.shape[:-1], np.uint32)
    for j in range(pf):
        words |= v[..., j] << np.uint32(bits * j)
    return np.ascontiguousarray(np.moveaxis(words.view(np.int32), -1, axis))


def _groups(w, g):
    out, n = w.shape
    G = -(-n // g)
    wp = np.pad(w, ((0, 0), (0, G * g - n)), constant_values=np.nan)
    return wp.reshape(out, G, g), G


def int_quantize(w, bits, group, sym):
    """Signed q [out, in], scale (f16-representable, f32) [out, G], signed zero [out, G] | None."""
    lo_q, hi_q = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    wg, G = _groups(w.astype(np.float64), group)
    if sym:
        s = np.nanmax(np.abs(wg), axis=2) / hi_q
        z = np.zeros_like(s)
    else:
        mn, mx = np.minimum(np.nanmin(wg, axis=2), 0), np.maximum(np.nanmax(wg, axis=2), 0)
        s = (mx - mn) / ((1 << bits) - 1)
        z = np.clip(np.round(-mn / s) + lo_q, lo_q, hi_q)
    s = s.astype(np.float16).astype(np.float32)
    q = np.round(wg / s[..., None].astype(np.float64)) + z[..., None]
    q = np.clip(np.nan_to_num(q), lo_q, hi_q).reshape(w.shape[0], -1)[:, : w.shape[1]].astype(np.int64)
    return q, s, (None if sym else z.astype(np.int64))


def deq_int(q, s, z, group):
    cols = np.arange(q.shape[1]) // group
    zz = 0 if z is None else z[:, cols]
    return ((q - zz) * s[:, cols].astype(np.float64)).astype(np.float32)


def ct_packed(w, bits, group, sym):
    q, s, z = int_quantize(w, bits, group, sym)
    off = 1 << (bits - 1)
    t = {"weight_packed": pack_words(q + off, bits, 1), "weight_scale": s.astype(np.float16),
         "weight_shape": np.array(w.shape, np.int32)}
    if z is not None:
        t["weight_zero_point"] = pack_words(z + off, bits, 0)
    return t, deq_int(q, s, z, group)


def ct_naive_int8(w, sym):
    q, s, z = int_quantize(w, 8, w.shape[1], sym)
    t = {"weight": q.astype(np.int8), "weight_scale": s}
    if z is not None:
        t["weight_zero_point"] = z.astype(np.int8)
    return t, deq_int(q, s, z, w.shape[1])


def fp8_quantize(w, scale_shape):
    """e4m3 values and the scale per tensor ([1]), channel ([out, 1]) or blocks ((bo, bi))."""
    out, n = w.shape
    if scale_shape == "tensor":
        s_full = np.full((out, n), np.abs(w).max() / 448, np.float32)
        s = np.array([np.abs(w).max() / 448], np.float32)
    elif scale_shape == "channel":
        s = (np.abs(w).max(axis=1, keepdims=True) / 448).astype(np.float32)
        s_full = np.broadcast_to(s, w.shape)
    else:
        bo, bi = scale_shape
        R, C = -(-out // bo), -(-n // bi)
        s = np.zeros((R, C), np.float32)
        for r in range(R):
            for c in range(C):
                s[r, c] = np.abs(w[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi]).max() / 448
        s_full = np.repeat(np.repeat(s, bo, 0), bi, 1)[:out, :n]
    q = (w / s_full).astype(FP8)
    return q, s, (q.astype(np.float64) * s_full.astype(np.float64)).astype(np.float32)


def ct_fp8(w, scale_shape):
    q, s, deq = fp8_quantize(w, scale_shape)
    return {"weight": q, "weight_scale": s, "input_scale": np.array([0.5], np.float32)}, deq


def fp8_block(w, block):
    q, s, deq = fp8_quantize(w, block)
    return {"weight": q, "weight_scale_inv": s}, deq


def gptq(w, bits, group, sym, v2=False):
    q, s, z = int_quantize(w, bits, group, sym)
    off = 1 << (bits - 1)
    u = q + off                                          # unsigned
    zu = (np.full_like(s, off, dtype=np.int64) if z is None else z + off)
    stored = zu if v2 else zu - 1
    G = s.shape[1]
    return ({"qweight": pack_words(u.T, bits, 0), "qzeros": pack_words(stored.T, bits, 1),
             "scales": np.ascontiguousarray(s.T).astype(np.float16),
             "g_idx": (np.arange(w.shape[1]) // group).astype(np.int32)},
            deq_int(q, s, None if z is None else z, group) if G else None)


LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_quantized(src: str, out: str, ref: str, qcfg: dict, writer) -> None:
    """``out``: ``src``'s checkpoint with every matrix ``writer(name, w)`` quantizes (it returns
    (tensors, deq) or None: kept float) in the format, config.json's quantization_config set;
    ``ref``: the float checkpoint of the weights those tensors stand for."""
    for d in (out, ref):
        shutil.copytree(src, d)
        for f in os.listdir(d):
            if f.endswith(".safetensors"):
                os.remove(os.path.join(d, f))
    floats = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            floats.update(load_file(os.path.join(src, f)))
    qt, rt = {}, {}
    for name, w in floats.items():
        got = writer(name, w) if name.endswith(".weight") and w.ndim == 2 else None
        if got is None:
            qt[name] = rt[name] = w
            continue
        tensors, deq = got
        module = name[: -len(".weight")]
        qt.update({f"{module}.{k}": v for k, v in tensors.items()})
        rt[name] = deq
    save_file(qt, os.path.join(out, "model.safetensors"))
    save_file(rt, os.path.join(ref, "model.safetensors"))
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qcfg
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
