"""Pooling inside the compiled step: a flat ragged batch's hidden states -> one vector per prompt."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.pooling.config import PoolerConfig


def pool(cfg: PoolerConfig, hidden, seq_ids, query_start_loc):
    """hidden [T, D] float32; seq_ids [T] int32 (each token's prompt row, -1 for padding);
    query_start_loc [S+1] int32 (row s's tokens are ``[qsl[s], qsl[s+1])``; padding rows are
    empty) -> [S, D] float32, or with ALL the hidden states themselves [T, D] (the runner cuts
    them per prompt).  ``cfg`` is static: one program per pooler."""
    S = query_start_loc.shape[0] - 1
    if cfg.pooling_type == "ALL":
        out = hidden                                                                # [T, D]
    elif cfg.pooling_type == "CLS":
        out = hidden[query_start_loc[:-1]]                                          # [S, D]
    elif cfg.pooling_type == "LAST":
        out = hidden[jnp.maximum(query_start_loc[1:] - 1, 0)]                       # [S, D]
    else:   # MEAN over the prompt's tokens
        member = (seq_ids[None, :] == jnp.arange(S, dtype=seq_ids.dtype)[:, None]).astype(jnp.float32)   # [S, T]
        sums = jax.lax.dot_general(member, hidden, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                                   precision=jax.lax.Precision.HIGHEST)             # [S, D]
        out = sums / jnp.maximum(jnp.sum(member, axis=1, keepdims=True), 1.0)
    if cfg.normalize:   # torch's F.normalize: x / max(||x||, 1e-12), per token with ALL
        out = out / jnp.maximum(jnp.linalg.norm(out, axis=-1, keepdims=True), 1e-12)
    return out
