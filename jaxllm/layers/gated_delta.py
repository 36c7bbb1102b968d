"""The gated delta rule (Gated DeltaNet, the linear attention of Qwen3-Next / Qwen3.5) in JAX.

Per value head, a state ``S [Dk, Dv]`` is carried along the sequence; at token ``t``, with
``a_t = exp(g_t)`` (``g_t <= 0``: the decay in log space) and the write strength ``beta_t``:

    S    <- a_t * S
    S    <- S + k_t (beta_t (v_t - S^T k_t))^T      # the delta rule: write the error
    o_t   = S^T q_t

with ``q`` and ``k`` L2-normalised per head (``use_qk_l2norm``) and ``q`` scaled by
``Dk ** -0.5``.  q / k heads may be fewer than value heads (each serves ``Hv / Hk``
consecutive value heads, as transformers and FLA group them).

Implementations of the same function, all taking and returning the per-sequence
state ``[B, Hv, Dk, Dv]`` (float32):

* :func:`chunk_gated_delta_rule` (prefill): the sequence cut into chunks of ``chunk_size``;
  within a chunk the sequential delta updates are condensed into matmuls by the WY / UT
  transform (one unit-lower-triangular solve per chunk), and a ``lax.scan`` carries the state
  from chunk to chunk.  Work is O(T C (Dk + Dv)) + O(T Dk Dv), all of it in matmuls.
* :func:`segmented_gated_delta_rule` (the engine's ragged steps, decodes too): the same
  chunks, each a segment of one sequence's tokens (:func:`segments`; one token: the
  recurrent update), run in order by a loop over the step's segments only, with each
  sequence's state taken at its first segment and left at its last; on the CPU's native
  kernels the one-token sequences all at once by ``cpu/gated_delta.cc``, on their rows in place.
* :func:`recurrent_gated_delta_rule` (decode, or any short run): a ``lax.scan`` over tokens.
* :func:`reference_gated_delta_rule`: the token loop in numpy float64, the tests' oracle.

Padding: ``length [B]`` (optional) says how many leading tokens of each row are real; the
others have their k, v, g and beta zeroed, which leaves the state exactly as the last real
token left it (a zero key writes nothing, a zero log-decay keeps everything), and their
outputs are zero.  A chunk-size-ragged tail is padded the same way inside.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.cpu import native
from jaxllm.formats.gdn_inputs import L2_EPS, prepare


def _chunk_terms(q, k, v, g, beta):
    """A chunk's state-independent terms: q, k [..., C, Dk], v [..., C, Dv], g, beta [..., C]
    -> u [..., C, Dv], w [..., C, Dk], q_dec [..., C, Dk], k_dec [..., C, Dk], attn [..., C, C],
    chunk_decay [...] (the leading axes batch independent chunks)."""
    C, Dv = k.shape[-2], v.shape[-1]
    gc = jnp.cumsum(g, axis=-1)                                        # [..., C] log decay since chunk start
    causal = jnp.tril(jnp.ones((C, C), bool))                          # i >= j
    # decay[i, j] = exp(gc_i - gc_j) for j <= i (<= 1: no overflow), else 0
    diff = gc[..., :, None] - gc[..., None, :]                         # [..., C, C]
    decay = jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0.0)), 0.0)
    k_beta = k * beta[..., None]                                       # [..., C, Dk]
    v_beta = v * beta[..., None]                                       # [..., C, Dv]
    # The UT transform: (I + L) u = v_beta, (I + L) w = k_beta * exp(gc), L the strictly
    # lower part of (k_beta k^T) * decay; u are the chunk's new values before the old state
    # is subtracted, w the decayed keys reading the old state.
    lower = jnp.einsum("...cd,...sd->...cs", k_beta, k) * decay
    lower = jnp.where(jnp.tril(jnp.ones((C, C), bool), -1), lower, 0.0) + jnp.eye(C, dtype=jnp.float32)
    rhs = jnp.concatenate([v_beta, k_beta * jnp.exp(gc)[..., None]], axis=-1)   # [..., C, Dv + Dk]
    uw = jax.lax.linalg.triangular_solve(lower, rhs, left_side=True, lower=True, unit_diagonal=True)
    u, w = uw[..., :Dv], uw[..., Dv:]
    attn = jnp.einsum("...cd,...sd->...cs", q, k) * decay              # [..., C, C] intra-chunk
    q_dec = q * jnp.exp(gc)[..., None]                                 # reads the state at chunk start
    k_dec = k * jnp.exp(gc[..., -1:] - gc)[..., None]                  # writes decayed to chunk end
    chunk_decay = jnp.exp(gc[..., -1])                                 # [...]
    return u, w, q_dec, k_dec, attn, chunk_decay


def _chunk_step(s, u, w, q_dec, k_dec, attn, chunk_decay):
    """One chunk from the state at its start: s [..., Dk, Dv] and :func:`_chunk_terms`' terms
    of the chunk -> (the state at its end, o [..., C, Dv])."""
    v_new = u - jnp.einsum("...cd,...de->...ce", w, s)                 # [..., C, Dv]
    o = jnp.einsum("...cd,...de->...ce", q_dec, s) + jnp.einsum("...cs,...se->...ce", attn, v_new)
    s = s * chunk_decay[..., None, None] + jnp.einsum("...cd,...ce->...de", k_dec, v_new)
    return s, o


def _token_step(s, q_t, k_t, v_t, g_t, b_t):
    """One token's update: s [..., Dk, Dv], q_t, k_t [..., Dk], v_t [..., Dv], g_t, b_t [...]
    -> (the state after it, o [..., Dv]).  Written so that the state is read twice (k and q
    against it in one contraction, then the update) and written once: with a = exp(g),
    s' = a s + k d^T where d = beta (v - a s^T k), and o = s'^T q = a s^T q + (k . q) d."""
    a = jnp.exp(g_t)                                                    # [...]
    kq = jnp.einsum("...cd,...de->...ce", jnp.stack([k_t, q_t], axis=-2), s)   # [..., 2, Dv]: s^T k, s^T q
    d = (v_t - a[..., None] * kq[..., 0, :]) * b_t[..., None]           # [..., Dv]
    s = a[..., None, None] * s + k_t[..., :, None] * d[..., None, :]
    o = a[..., None] * kq[..., 1, :] + jnp.sum(k_t * q_t, axis=-1, keepdims=True) * d
    return s, o


@partial(jax.jit, static_argnames=("chunk_size", "use_qk_l2norm", "scale"))
def chunk_gated_delta_rule(q, k, v, g, beta, state, length=None, *, chunk_size: int = 64,
                           use_qk_l2norm: bool = True, scale: float | None = None):
    """q, k [B, T, Hk, Dk], v [B, T, H, Dv], g, beta [B, T, H], state [B, H, Dk, Dv]
    -> (o [B, T, H, Dv] float32, state [B, H, Dk, Dv] float32), chunk by chunk."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    B, T = k.shape[:2]
    q, k, v, g, beta = prepare(q, k, v, g, beta, length, use_qk_l2norm, scale)
    H, Dv = v.shape[2], v.shape[-1]
    C = chunk_size
    pad = (-T) % C
    N = (T + pad) // C

    def chunks(x):   # [B, T, H, ...] -> [B, H, N, C, ...], the tail zero-padded
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = jnp.moveaxis(x, 2, 1)
        return x.reshape(B, H, N, C, *x.shape[3:])

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))       # [B, H, N, C, D] / [B, H, N, C]
    u, w, q_dec, k_dec, attn, chunk_decay = _chunk_terms(q, k, v, g, beta)

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (u, w, q_dec, k_dec, attn, chunk_decay))   # N leading
    state, o = jax.lax.scan(lambda s, x: _chunk_step(s, *x), state.astype(jnp.float32), xs)   # o [N, B, H, C, Dv]
    o = jnp.moveaxis(o, 0, 2).reshape(B, H, N * C, Dv)[:, :, :T]      # [B, H, T, Dv]
    o = jnp.moveaxis(o, 1, 2)                                          # [B, T, H, Dv]
    if length is not None:
        o = jnp.where((jnp.arange(T)[None, :] < length[:, None])[..., None, None], o, 0.0)
    return o, state


def segments(query_start_loc: jax.Array, num_tokens: int, chunk_size: int):
    """Cuts a ragged step's flat tokens into segments of at most ``chunk_size`` consecutive
    tokens of one sequence, each sequence's from its first token, in order: query_start_loc
    [S + 1] -> (seq, start, length, first, last), each [N] with N = ceil(T / C) + S, the
    most segments T tokens in S sequences can need, and ``used`` (a scalar): the segments
    this step has, the first ``used`` of the N.  Segment n holds tokens start[n] ..
    start[n] + length[n] - 1 of sequence seq[n]; first / last: it is the sequence's first /
    last; unused segments have length 0 and are neither."""
    C = chunk_size
    S = query_start_loc.shape[0] - 1
    start, length = query_start_loc[:-1], query_start_loc[1:] - query_start_loc[:-1]   # [S]
    count = (length + C - 1) // C                                       # [S] segments per sequence
    end = jnp.cumsum(count)                                             # [S] segments up to and with s
    n = jnp.arange(-(-num_tokens // C) + S, dtype=jnp.int32)            # [N]
    seq = jnp.searchsorted(end, n, side="right").astype(jnp.int32)      # [N] (S: past the last)
    used = seq < S
    seq = jnp.minimum(seq, S - 1)
    i = n - (end[seq] - count[seq])                                     # [N] its index in the sequence
    seg_len = jnp.where(used, jnp.clip(length[seq] - i * C, 0, C), 0)
    return seq, start[seq] + i * C, seg_len, used & (i == 0), used & (i == count[seq] - 1), end[-1]


@partial(jax.jit, static_argnames=("chunk_size", "use_qk_l2norm", "scale", "backend"))
def segmented_gated_delta_rule(q, k, v, g, beta, states, seq, start, length, first, last, used, fresh, *,
                               chunk_size: int, use_qk_l2norm: bool = True, scale: float | None = None,
                               backend: str = "xla"):
    """The chunked form over :func:`segments`' segments of a ragged step's flat tokens
    instead of ``[B, T]`` rows: q, k [T, Hk, Dk], v [T, H, Dv], g, beta [T, H]; states
    [R, H, Dk, Dv]; ``seq [N]`` the row of ``states`` each segment's sequence starts from and
    ends in (:func:`segments`' sequence index, or the engine's state slot of it); start,
    length, first, last [N] and ``used`` from :func:`segments`; fresh [N]: the segment's
    sequence starts from zeros, not from its row -> (o [T, H, Dv] float32, zero
    where no segment covers a token; states, each used row left as its sequence's last
    segment leaves it, the others as given, in the given dtype).

    A loop over the ``used`` segments, in order, each a chunk of
    :func:`chunk_gated_delta_rule` (the same terms and step) on the ``chunk_size`` tokens
    from its start, those past its length masked: a sequence's state is read at its first
    segment and written at its last (only those rows are touched: the engine passes all its
    slots, updated in place), and each segment writes its ``chunk_size`` outputs at its
    start (the masked ones zero; the next segment, run later, overwrites them).  A segment of
    one token (a decode) takes the recurrent update instead.  The work is the step's
    segments' (at most T / C + one per sequence), not the N of the bound (one per row of the
    step's bucket).

    ``backend="native"`` (the CPU's kernels, cpu/gated_delta.cc): the sequences of one token
    this step (decodes), each a segment alone that touches only its own row, are updated
    first, all in one call on their rows in place (each state read once and written once),
    and the loop runs over the other segments only."""
    T = k.shape[0]
    C = chunk_size
    q, k, v, g, beta = (x[0] for x in prepare(q[None], k[None], v[None], g[None], beta[None], None,
                                              use_qk_l2norm, scale))    # [T, H, D] / [T, H]
    # C zero rows after the tokens: every segment's window [start, start + C) is in range
    pad = lambda x: jnp.pad(x, [(0, C)] + [(0, 0)] * (x.ndim - 1))     # noqa: E731
    q, k, v, g, beta = (pad(x) for x in (q, k, v, g, beta))            # [T + C, H, ...]
    H, Dv = v.shape[1], v.shape[2]

    def chunk(s, n):
        # the segment as a chunk: [C, H, ...] windows, those past its length masked
        valid = jnp.arange(C) < length[n]                               # [C]
        window = lambda x: jnp.moveaxis(jnp.where(                      # noqa: E731  [C, H, ...] -> [H, C, ...]
            valid.reshape((C,) + (1,) * (x.ndim - 1)), jax.lax.dynamic_slice_in_dim(x, start[n], C, 0), 0.0), 0, 1)
        s, o_n = _chunk_step(s, *_chunk_terms(window(q), window(k), window(v), window(g), window(beta)))
        return s, jnp.moveaxis(o_n, 0, 1) * valid[:, None, None]         # [C, H, Dv]

    def one_token(s, n):
        # a segment of one token (a decode): the recurrent update, ~C times less work than a
        # chunk of one real token
        s, o_t = _token_step(s, *(x[start[n]] for x in (q, k, v, g, beta)))   # o_t [H, Dv]
        return s, jnp.zeros((C, H, Dv), jnp.float32).at[0].set(o_t)

    def segment(n, carry):
        s, states, o = carry
        row = states[seq[n]]                                            # [H, Dk, Dv]
        s = jnp.where(first[n], jnp.where(fresh[n], 0.0, row.astype(jnp.float32)), s)
        s, o_n = jax.lax.cond(length[n] == 1, one_token, chunk, s, n)   # o_n [C, H, Dv]
        o = jax.lax.dynamic_update_slice_in_dim(o, o_n, start[n], 0)
        states = jax.lax.dynamic_update_index_in_dim(states, jnp.where(last[n], s.astype(states.dtype), row), seq[n], 0)
        return s, states, o

    order, count = jnp.arange(seq.shape[0]), used                      # [N]: the loop's segments, in order
    if backend == "native":
        live = jnp.arange(seq.shape[0]) < used                          # [N]
        alone = live & first & last & (length == 1)                     # [N] a sequence of one token
        rows = jnp.where(alone, seq, states.shape[0])                   # out of range: not one of them
        o_1, states = native.gdn_token(*(x[start] for x in (q, k, v, g, beta)), rows, fresh, states)   # [N, H, Dv]
        rest = live & ~alone
        order, count = jnp.argsort(~rest, stable=True), jnp.sum(rest)   # the others first, in order
    init = (jnp.zeros(states.shape[1:], jnp.float32), states, jnp.zeros((T + C, H, Dv), jnp.float32))
    _, states, o = jax.lax.fori_loop(0, count, lambda i, carry: segment(order[i], carry), init)
    if backend == "native":
        # after the loop: its segments write C rows of outputs from their start, zeros past their length
        o = o.at[jnp.where(alone, start, T + C)].set(o_1, mode="drop")
    return o[:T], states


@partial(jax.jit, static_argnames=("use_qk_l2norm", "scale"))
def recurrent_gated_delta_rule(q, k, v, g, beta, state, length=None, *, use_qk_l2norm: bool = True,
                               scale: float | None = None):
    """Same arguments and results as :func:`chunk_gated_delta_rule`, token by token."""
    T = k.shape[1]
    q, k, v, g, beta = prepare(q, k, v, g, beta, length, use_qk_l2norm, scale)
    # s [B, H, Dk, Dv]; each token's q_t, k_t [B, H, Dk], v_t [B, H, Dv], g_t, b_t [B, H]
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))       # T leading
    state, o = jax.lax.scan(lambda s, x: _token_step(s, *x), state.astype(jnp.float32), xs)   # o [T, B, H, Dv]
    o = jnp.moveaxis(o, 0, 1)
    if length is not None:
        o = jnp.where((jnp.arange(T)[None, :] < length[:, None])[..., None, None], o, 0.0)
    return o, state


def reference_gated_delta_rule(q, k, v, g, beta, state, *, use_qk_l2norm: bool = True,
                               scale: float | None = None):
    """The token loop in numpy float64 (the oracle): same shapes as the JAX functions, every
    row's tokens all real."""
    q, k, v, g, beta, s = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, state))
    Hk, Dk = k.shape[2:]
    T, H = v.shape[1:3]
    q, k = np.repeat(q, H // Hk, axis=2), np.repeat(k, H // Hk, axis=2)
    if use_qk_l2norm:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + L2_EPS)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + L2_EPS)
    q = q * (Dk ** -0.5 if scale is None else scale)
    s = s.copy()
    o = np.zeros(v.shape, np.float64)
    for t in range(T):
        s *= np.exp(g[:, t])[..., None, None]
        delta = (v[:, t] - np.einsum("bhd,bhde->bhe", k[:, t], s)) * beta[:, t][..., None]
        s += k[:, t][..., :, None] * delta[..., None, :]
        o[:, t] = np.einsum("bhd,bhde->bhe", q[:, t], s)
    return o, s
