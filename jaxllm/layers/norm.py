"""RMSNorm, computed in float32 whatever the activation dtype (as transformers does)."""

import jax
import jax.numpy as jnp

from jaxllm.cpu import native as cpu_native


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, native: bool = False) -> jax.Array:
    # x [..., D], weight [D]; native: the CPU kernel (cpu/norm.cc), whose rows are summed in
    # one order whatever the step's shape (XLA's are not: a token's logits would then differ
    # between a decode and a speculative verification)
    if native and x.dtype == jnp.float32 and weight.dtype == jnp.float32 and x.shape[0]:
        return cpu_native.rms_norm(x, weight, eps)
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)
