"""The sampler's references: the serial host reference (numpy), the oracle of the order gate,
and the sort-based device baseline of the truncation.

:func:`sample_row` processes one row as the device does (same float32 operations in the
same order, from ``numerics.py``) but without any of the device's shortcuts: top-k and
top-p from a plain sort with the masses accumulated token by token in descending order
(exact int64 running sums), and the draw as an explicit loop over the vocabulary that keeps
the first maximum.  The parallel sampler must return exactly this token for every row,
whatever the batch layout.

:func:`truncation_threshold_reference` is the truncation key the device computes without
its candidate search (a full sort of every row, jnp), and :func:`sample_reference` the
device sampler built on it: the baseline that ``truncation.py`` replaces, for the tests
and ``bench/sampler.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.formats import numerics as nx
from jaxllm.formats.gumbel import gumbel_noise_np, runtime_zero
from jaxllm.sample.arrays import SamplerState, SamplingMetadata
from jaxllm.sample.blocked import NEG_INF, blocked_argmax
from jaxllm.sample.draw import gumbel_argmax
from jaxllm.sample.metadata import RowParams, log_min_p
from jaxllm.sample.processing import process_logits
from jaxllm.sample.truncation import apply_key, kept_mass, scaled_logits

_F = np.float32


def process_row(logits: np.ndarray, p: RowParams, counts: np.ndarray | None = None,
                prompt_mask: np.ndarray | None = None, suppress: list[int] = ()) -> np.ndarray:
    """Allowed / bad tokens, min_tokens, logit_bias, penalties: [V] float32 -> [V] float32."""
    x = np.array(logits, dtype=np.float32)
    V = x.shape[0]
    with np.errstate(invalid="ignore", over="ignore"):
        if p.bias_row is not None:
            x = x + p.bias_row
        for t in suppress:
            x[t] = -np.inf
        if p.uses_penalties:
            c = np.zeros(V, np.int64) if counts is None else np.asarray(counts, np.int64)
            pm = np.zeros(V, bool) if prompt_mask is None else np.asarray(prompt_mask, bool)
            out = c > 0
            occurred = pm | out
            rep = _F(p.repetition_penalty)
            xr = np.where(occurred, np.where(x > 0, x / rep, x * rep), x)
            xf = xr - _F(p.frequency_penalty) * c.astype(np.float32)
            x = np.where(out, xf - _F(p.presence_penalty), xf).astype(np.float32)
    return x


def first_argmax(y) -> int:
    """The lowest index of the maximum, one element at a time."""
    best, arg = -np.inf, 0
    for i, v in enumerate(y.tolist()):
        if v > best:
            best, arg = v, i
    return arg


def truncate_row(x1: np.ndarray, p: RowParams) -> np.ndarray:
    """Temperature-scaled [V] -> the entries min_p, top-k and top-p keep (others -inf)."""
    V = x1.shape[0]
    x1 = np.where(x1 == 0, _F(0.0), x1).astype(np.float32)
    m = x1.max()
    with np.errstate(invalid="ignore"):
        x1 = np.where(x1 - m < log_min_p(p.min_p), _F(-np.inf), x1).astype(np.float32)
    keys = nx.float_key(x1, np)
    tau = np.uint32(0)
    desc = np.sort(x1)[::-1]
    if p.top_k > 0:
        tau = nx.float_key(desc[min(p.top_k, V) - 1:min(p.top_k, V)], np)[0]
    if p.top_p < 1.0:
        kept = keys >= tau
        with np.errstate(invalid="ignore", over="ignore"):
            e = nx.exp_nonpos(np.where(kept, x1, _F(-np.inf)) - m, np)
        total = nx.combine(*(np.uint32(int(a.astype(np.int64).sum())) for a in nx.limbs(e, np)), xp=np)
        target = _F(p.top_p) * total
        dk = desc[nx.float_key(desc, np) >= tau]
        with np.errstate(invalid="ignore", over="ignore"):
            limbs = nx.limbs(nx.exp_nonpos(dk - m, np), np)
        # Running sums in descending order (exact int64), each turned into a mass.
        cum = [np.cumsum(a.astype(np.int64)).astype(np.uint32) for a in limbs]
        j = int(np.argmax(nx.combine(*cum, xp=np) >= target))          # first token reaching it
        tau = max(tau, nx.float_key(dk[j:j + 1], np)[0])
    return np.where(keys >= tau, x1, _F(-np.inf)).astype(np.float32)


def sample_row(logits: np.ndarray, p: RowParams, out_pos: int, counts=None, prompt_mask=None,
               suppress: list[int] = (), fp64: bool = False) -> int:
    """The token the sampler draws for one row (greedy when ``p.temperature`` is 0)."""
    x = process_row(logits, p, counts, prompt_mask, suppress)
    if p.temperature <= 0.0:
        return first_argmax(x)
    xf = truncate_row(x / _F(p.temperature), p)
    g = gumbel_noise_np(p.seed, out_pos, x.shape[0], fp64)
    y = xf.astype(g.dtype) + g
    return first_argmax(y)


# ---------------------------------------------------------------- the device baseline (jnp)

def truncation_threshold_reference(x: jax.Array, m: jax.Array, md: SamplingMetadata, zero: jax.Array) -> jax.Array:
    """The whole truncation key per row ([S] u32) from a full sort: x [S, V] temperature-scaled,
    min_p applied, no -0.0; m [S] the row maximum.  The k-th value and the first value whose
    descending cumulative fixed-point mass reaches ``top_p`` of the total are read off the
    sorted row; the same keys as ``truncation.truncation_threshold`` + ``whole_key``."""
    S, V = x.shape
    k_eff = jnp.where(md.top_k > 0, jnp.minimum(md.top_k, V), V)         # [S]
    u0 = jnp.uint32(0)
    sv = jnp.sort(x, axis=-1)[:, ::-1]                                   # [S, V] descending
    row_k = jnp.take_along_axis(sv, (k_eff - 1)[:, None], axis=1)[:, 0]
    tau_k = jnp.where(md.top_k > 0, nx.float_key(row_k), u0)

    def top_p():
        target = md.top_p * kept_mass(x, tau_k, m, zero)                 # [S]
        svk = jnp.where(nx.float_key(sv) >= tau_k[:, None], sv, NEG_INF)
        cl = [c.astype(jnp.uint32) for c in nx.limbs(nx.exp_nonpos(svk - m[:, None], jnp, zero))]
        cm = nx.combine(*(jnp.cumsum(c, axis=1, dtype=jnp.uint32) for c in cl))   # [S, V] non-decreasing
        j = jnp.sum(jnp.where(cm < target[:, None], 1, 0), axis=1)       # first index reaching it
        row_p = jnp.take_along_axis(svk, jnp.minimum(j, V - 1)[:, None], axis=1)[:, 0]
        tau_p = jnp.where(md.top_p < 1.0, nx.float_key(row_p), u0)
        return jnp.maximum(tau_k, tau_p)

    return jax.lax.cond(jnp.any(md.top_p < 1.0), top_p, lambda: tau_k)


def _random_rows_reference(x, greedy, md: SamplingMetadata, zero, fp64: bool):
    S = x.shape[0]
    is_random = md.temperature > 0.0
    x1, m = scaled_logits(x, md, is_random)
    truncated = is_random & ((md.top_k > 0) | (md.top_p < 1.0))
    tau = jax.lax.cond(jnp.any(truncated), lambda: truncation_threshold_reference(x1, m, md, zero),
                       lambda: jnp.zeros((S,), jnp.uint32))
    xf = apply_key(x1, tau)                                              # [S, V]
    if fp64:
        with jax.enable_x64(True):
            drawn = gumbel_argmax(xf, md, fp64, is_random)
    else:
        drawn = gumbel_argmax(xf, md, fp64, is_random)
    return jnp.where(is_random, drawn, greedy)


def sample_reference(logits: jax.Array, md: SamplingMetadata, state: SamplerState, *, fp64: bool = False) -> jax.Array:
    """The device sampler with the sort-based truncation: logits [S, V] -> tokens [S] i32, the
    tokens ``sampler.sample`` draws (same processing and draw, no candidate shortcuts in the
    truncation)."""
    zero = runtime_zero(md.out_pos)                                      # [S, 1]
    x = process_logits(logits, md, state, zero)                          # [S, V]
    greedy = blocked_argmax(x)
    return jax.lax.cond(jnp.any(md.temperature > 0.0), lambda: _random_rows_reference(x, greedy, md, zero, fp64),
                        lambda: greedy)
