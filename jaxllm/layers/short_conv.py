"""The short causal depthwise convolution of Gated DeltaNet layers, with its per-sequence state.

Each channel ``c`` is convolved with its own ``K`` taps over the last ``K`` tokens, then
SiLU: ``y_t[c] = silu(sum_j w[c, j] * x_{t - K + 1 + j}[c])`` (transformers' ``conv1d`` with
``groups=C`` and ``K - 1`` left padding, no bias in Qwen3-Next / Qwen3.5).  Across calls
the tokens before the first are read from the conv state ``[B, K - 1, C]``: the last
``K - 1`` inputs of the sequence so far (zeros at its start).  Prefill and the one-token
decode update are the same function of (state, new tokens); :func:`conv_step` is the
one-token case written without the window gather.  :func:`conv_ragged_on_slots` is the
engine's step: a ragged batch's flat tokens on the sequences' rows of every slot's state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.cpu import native


def conv_prefill(x: jax.Array, weight: jax.Array, state: jax.Array, length: jax.Array | None = None,
                 activation: bool = True) -> tuple[jax.Array, jax.Array]:
    """x [B, T, C], weight [C, K], state [B, K - 1, C] -> (y [B, T, C] float32, state [B, K - 1, C]).

    ``length [B]`` (optional): the real tokens of each row (the rest padding); the new state
    is then the ``K - 1`` inputs before token ``length``, as if the padding was never there."""
    T = x.shape[1]
    K = weight.shape[1]
    xs = jnp.concatenate([state.astype(jnp.float32), x.astype(jnp.float32)], axis=1)   # [B, K - 1 + T, C]
    w = weight.astype(jnp.float32)
    y = sum(xs[:, j:j + T] * w[:, j] for j in range(K))                             # [B, T, C]
    if activation:
        y = jax.nn.silu(y)
    if length is None:
        new_state = xs[:, T:]
    else:   # rows length .. length + K - 2 of xs: the K - 1 inputs before token `length`
        idx = length[:, None] + jnp.arange(K - 1)[None, :]                           # [B, K - 1]
        new_state = jnp.take_along_axis(xs, idx[..., None], axis=1)
    return y, new_state.astype(state.dtype)


def conv_step(x: jax.Array, weight: jax.Array, state: jax.Array,
              activation: bool = True) -> tuple[jax.Array, jax.Array]:
    """One token: x [B, C], weight [C, K], state [B, K - 1, C] -> (y [B, C] float32, state)."""
    window = jnp.concatenate([state.astype(jnp.float32), x.astype(jnp.float32)[:, None]], axis=1)  # [B, K, C]
    y = jnp.einsum("bkc,ck->bc", window, weight.astype(jnp.float32))
    if activation:
        y = jax.nn.silu(y)
    return y, window[:, 1:].astype(state.dtype)


def conv_prefill_ragged(x: jax.Array, weight: jax.Array, state: jax.Array, start: jax.Array, length: jax.Array,
                        token_seq: jax.Array, activation: bool = True) -> tuple[jax.Array, jax.Array]:
    """:func:`conv_prefill` of a ragged step's flat tokens, the same arithmetic: x [T, C] (sequence
    s's ``length[s]`` tokens from ``start[s]``, token t in sequence ``token_seq[t]``), weight
    [C, K], state [S, K - 1, C] -> (y [T, C] float32, state [S, K - 1, C]).  A tap that reaches
    back before its sequence's first token reads the sequence's state, as the rows' form reads
    ``concat(state, x)``; tokens in no sequence (padding) get values that are not used."""
    T = x.shape[0]
    S, K = state.shape[0], weight.shape[1]
    xf, st, w = x.astype(jnp.float32), state.astype(jnp.float32), weight.astype(jnp.float32)
    t = jnp.arange(T)
    seq = jnp.clip(token_seq, 0, S - 1)                                          # [T]
    off = t - start[seq]                                                         # [T] index in its sequence
    y = 0
    for j in range(K):
        back = off - (K - 1) + j                                                 # [T] the input's index in the sequence
        from_x = xf[jnp.clip(t - (K - 1) + j, 0, T - 1)]                         # [T, C]
        from_state = st[seq, jnp.clip(off + j, 0, K - 2)]                        # [T, C] state row K - 1 + back
        y = y + jnp.where((back >= 0)[:, None], from_x, from_state) * w[:, j]
    if activation:
        y = jax.nn.silu(y)
    # each sequence's K - 1 inputs before its token length: rows length .. length + K - 2 of concat(state, x)
    p = length[:, None] + jnp.arange(K - 1)[None, :]                             # [S, K - 1]
    from_x = xf[jnp.clip(start[:, None] + p - (K - 1), 0, T - 1)]                # [S, K - 1, C]
    from_state = jnp.take_along_axis(st, jnp.clip(p, 0, K - 2)[..., None], axis=1)
    new_state = jnp.where((p >= K - 1)[..., None], from_x, from_state)
    return y, new_state.astype(state.dtype)


def conv_ragged_on_slots(x: jax.Array, weight: jax.Array, states: jax.Array, rows: jax.Array, start: jax.Array,
                         length: jax.Array, fresh: jax.Array, token_seq: jax.Array, *,
                         backend: str = "xla") -> tuple[jax.Array, jax.Array]:
    """:func:`conv_prefill_ragged` on every slot's state: states [R, K - 1, C]; rows [S] each
    sequence's row of it (out of range: a padding sequence, read as zeros, not written);
    fresh [S]: it starts from zeros, not from its row -> (y [T, C] float32, states with each
    sequence's row left after its tokens, the others as given).  ``backend="native"``: the
    CPU kernel (cpu/short_conv.cc), on the rows in place; "xla": the rows gathered, convolved
    and scattered back."""
    if backend == "native":
        y, states = native.conv_ragged(x, weight, states, rows, start, length, fresh)   # [T, C]
        return jax.nn.silu(y), states
    own = jnp.take(states, rows, axis=0, mode="fill", fill_value=0)                      # [S, K - 1, C]
    own = jnp.where(fresh[:, None, None], 0.0, own)
    y, new = conv_prefill_ragged(x, weight, own, start, length, token_seq)
    return y, states.at[rows].set(new.astype(states.dtype), mode="drop")
