"""The gated delta rule's input preparation: the front end every implementation shares (the
chunked and recurrent XLA forms in ``layers/gated_delta.py`` and the Pallas kernel in
``pallas/gated_delta.py``), so that all of them see the same float32 inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp

L2_EPS = 1e-6
"""transformers' (and FLA's) epsilon in ``x * rsqrt(sum(x^2) + eps)``."""


def _l2norm(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def prepare(q, k, v, g, beta, length, use_qk_l2norm, scale):
    """The implementations' shared front end (the Pallas kernel's too): float32, q/k heads
    repeated to the value heads, normalised, scaled, padding tokens' k/v/g/beta zeroed
    -> q, k [B, T, H, Dk], v [B, T, H, Dv], g, beta [B, T, H]."""
    T, Hk, Dk = k.shape[1:]
    H = v.shape[2]
    if H % Hk:
        raise ValueError(f"value heads ({H}) must be a multiple of key heads ({Hk})")
    q, k, v, g, beta = (x.astype(jnp.float32) for x in (q, k, v, g, beta))
    if H != Hk:
        q, k = jnp.repeat(q, H // Hk, axis=2), jnp.repeat(k, H // Hk, axis=2)
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * (Dk ** -0.5 if scale is None else scale)
    if length is not None:
        valid = jnp.arange(T)[None, :] < length[:, None]                  # [B, T]
        k = jnp.where(valid[..., None, None], k, 0.0)
        v = jnp.where(valid[..., None, None], v, 0.0)
        g = jnp.where(valid[..., None], g, 0.0)
        beta = jnp.where(valid[..., None], beta, 0.0)
    return q, k, v, g, beta
