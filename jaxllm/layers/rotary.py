"""Rotary position embeddings: inverse frequencies (with llama3 / linear scaling) and their application.

The inverse frequencies are computed once on the host in float32 exactly as transformers
computes them, and enter the compiled step as an argument, not a constant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class RopeScaling:
    """How the rotary frequencies are scaled (a checkpoint's ``rope_scaling``; read by
    ``models/config.py``)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    """YaRN: the ramp's bounds (rotations) and whether they are rounded to whole dimensions."""
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    """YaRN and LongRoPE: cos and sin are multiplied by this (transformers' ``attention_scaling``)."""
    short_factor: tuple[float, ...] = ()
    """LongRoPE (Phi-3): per-frequency divisors while a sequence fits the original context."""
    long_factor: tuple[float, ...] = ()
    """LongRoPE: the divisors once it is longer than ``original_max_position_embeddings``."""


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling,
                    freq_factors: np.ndarray | None = None) -> np.ndarray:
    """[head_dim // 2] float32 (``head_dim``: the rotated dims); LongRoPE: [head_dim], the
    short factors' frequencies then the long ones' (:func:`longrope_cos_sin` picks)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
    if scaling.rope_type == "longrope":
        # transformers: 1 / (ext_factors * base ** exponents), in float32
        base = (np.float32(theta) ** exponents).astype(np.float32)
        return np.concatenate([1.0 / (np.asarray(f, np.float32) * base)
                               for f in (scaling.short_factor, scaling.long_factor)]).astype(np.float32)
    if freq_factors is not None:
        # llama.cpp stores llama3-style scaling as per-frequency divisors (rope_freqs.weight).
        return (inv / freq_factors.astype(np.float32)).astype(np.float32)
    if scaling.rope_type == "linear":
        inv = inv / np.float32(scaling.factor)
    elif scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    elif scaling.rope_type == "yarn":
        inv = _yarn(head_dim, theta, scaling)
    return inv.astype(np.float32)


def _yarn(dim: int, theta: float, sc: RopeScaling) -> np.ndarray:
    """YaRN's frequencies (transformers' ``_compute_yarn_parameters``): interpolated by
    ``factor`` below a ramp over the dimensions, extrapolated (unchanged) above it; the ramp
    runs between the dimensions that turn ``beta_fast`` and ``beta_slow`` times over the
    original context.  Its ``attention_factor`` scales cos and sin (the model applies it)."""
    def correction_dim(rotations):
        return dim * math.log(sc.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = correction_dim(sc.beta_fast), correction_dim(sc.beta_slow)
    if sc.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim))
                 ).astype(np.float32)
    extrapolation = (1.0 / pos_freqs).astype(np.float32)
    interpolation = (1.0 / (np.float32(sc.factor) * pos_freqs)).astype(np.float32)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extra = (1 - ramp).astype(np.float32)
    return (interpolation * (1 - extra) + extrapolation * extra).astype(np.float32)


def cos_sin(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    # positions [T], inv_freq [Dh/2] -> cos, sin [T, Dh/2] float32
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]

    def rotations(f):
        return jnp.cos(f), jnp.sin(f)

    if jax.default_backend() != "cpu" or positions.shape[0] == 0:
        return rotations(freqs)
    # XLA:CPU fuses cos and sin into every layer's q and k rotation and evaluates them per
    # element and head: at batch 32, 60 rope fusions of ~70 us each, ~4 ms of a decode step.
    # An optimization_barrier is expanded away before fusion there, but a conditional's
    # results are buffers fusion cannot see into: both branches compute the same thing, and
    # the predicate only has to be unknown at compile time.  (Not on GPU, where a
    # conditional reads its predicate back to the host.)
    return jax.lax.cond(positions[0] >= 0, rotations, rotations, freqs)



def mrope_axes(rotary_dim: int, mrope_section) -> np.ndarray:
    """Multimodal RoPE, interleaved (Qwen3.5 / Qwen3-VL): int32 [rotary_dim / 2], which position
    stream (0 temporal, 1 height, 2 width) turns each frequency: ``j % 3 == 1`` below
    ``3 * mrope_section[1]`` height, ``j % 3 == 2`` below ``3 * mrope_section[2]`` width, else temporal."""
    j = np.arange(rotary_dim // 2)
    axes = np.zeros_like(j)
    axes[(j % 3 == 1) & (j < 3 * mrope_section[1])] = 1
    axes[(j % 3 == 2) & (j < 3 * mrope_section[2])] = 2
    return axes.astype(np.int32)


def mrope_cos_sin(positions: jax.Array, inv_freq: jax.Array, axes: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """positions [3, T] (t, h, w streams), inv_freq [R/2], axes [R/2] (:func:`mrope_axes`) ->
    cos, sin [T, R/2]: each frequency turned by its stream's position."""
    T = positions.shape[1]
    cos, sin = cos_sin(positions.reshape(-1), inv_freq)                  # [3T, R/2]
    axes = jnp.asarray(axes)[None, :]
    pick = lambda c: jnp.where(axes == 0, c[:T], jnp.where(axes == 1, c[T:2 * T], c[2 * T:]))
    return pick(cos), pick(sin)


def longrope_cos_sin(positions: jax.Array, inv_freq: jax.Array, long: jax.Array,
                     attention_factor: float) -> tuple[jax.Array, jax.Array]:
    """LongRoPE (Phi-3): positions [T], inv_freq [R] (short then long frequencies, R/2 each),
    long [T] bool: the token's sequence is longer than the original context -> cos, sin
    [T, R/2], scaled by ``attention_factor`` as transformers scales them."""
    half = inv_freq.shape[0] // 2
    short_cs, long_cs = cos_sin(positions, inv_freq[:half]), cos_sin(positions, inv_freq[half:])
    pick = long[:, None]
    return tuple(jnp.where(pick, lg, sh) * jnp.float32(attention_factor) for sh, lg in zip(short_cs, long_cs))


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    # x [T, H, Dh] in the "rotate half" layout of transformers; cos, sin [T, R/2]: the first
    # R dims of each head are rotated (partial rotary when R < Dh), the rest pass through.
    rot = 2 * cos.shape[-1]
    half = rot // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:rot]
    c, s = cos[:, None, :], sin[:, None, :]
    parts = [x1 * c - x2 * s, x2 * c + x1 * s]
    if rot < x.shape[-1]:
        parts.append(xf[..., rot:])
    return jnp.concatenate(parts, axis=-1).astype(x.dtype)
